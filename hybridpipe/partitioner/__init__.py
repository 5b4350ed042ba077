"""hybridpipe.partitioner"""
