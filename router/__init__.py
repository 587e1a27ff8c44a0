"""The front door of a pdserve cluster: the public ``pdserve.v1.Generation`` gRPC service.

Modules: ``config`` (frozen settings), ``preprocess`` (validation, tokenization, images),
``workers`` (worker pool, load tracking, selection), ``relay`` (worker stream -> client stream),
``service`` (the servicer), ``server`` (process wiring).
"""
