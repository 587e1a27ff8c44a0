"""The decode worker: remote rooms waiting for pages and transfers, continuous batching, the
token stream, its gRPC service and process; :mod:`decode_node.spec` for EAGLE."""
