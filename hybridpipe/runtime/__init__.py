"""hybridpipe.runtime"""
