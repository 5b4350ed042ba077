"""The cost model: the cluster, what moving and summing bytes costs on it (point-to-point
transfers and every all-reduce algorithm, written once as rounds of messages), its calibration from
measurements, and the per-layer all-reduce choice priced by it. Imports nothing else of the
partitioner: ``hybridpipe.comm`` needs only this."""
