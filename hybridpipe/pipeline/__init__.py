"""hybridpipe.pipeline"""
