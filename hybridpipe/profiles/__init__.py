"""hybridpipe.profiles"""
