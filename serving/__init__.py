"""What every node process shares: gRPC server start and serve-until-signal, TLS and tokens,
Prometheus metrics, request logs, ``Admin`` stats, the parse interceptor, admission and overload,
the exception -> gRPC status table and the engine-thread base of the worker loops."""
