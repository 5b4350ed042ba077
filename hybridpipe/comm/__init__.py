"""hybridpipe.comm"""
