"""The prefill worker: the bootstrap gate, chunked prefill with a KV push per chunk, its gRPC
service and process; :mod:`prefill_node.pipeline` for a pipeline-parallel prefill."""
