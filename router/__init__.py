"""The front door of a pdserve cluster: the public ``pdserve.v1.Generation`` gRPC service and an
OpenAI-compatible HTTP door over the same calls.

Modules: ``config`` (frozen settings), ``preprocess`` (validation, tokenization, images),
``workers`` (worker pool, load tracking, selection), ``room`` (one request's worker calls),
``relay`` (worker stream -> client stream), ``errors`` (errors that carry a gRPC status),
``service`` (the servicer), ``openai_request`` / ``openai_response`` (OpenAI JSON <-> proto),
``http_door`` (the HTTP server), ``server`` (process wiring), ``client`` (the other side: a
client of several routers that fails over between them).
"""
