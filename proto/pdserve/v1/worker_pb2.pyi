from proto.pdserve.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRequest(_message.Message):
    __slots__ = ("room", "request_id", "token_ids", "images", "sampling")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    room: int
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    images: _containers.RepeatedCompositeFieldContainer[_generate_pb2.ImagePatches]
    sampling: _generate_pb2.SamplingParams
    def __init__(self, room: _Optional[int] = ..., request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., images: _Optional[_Iterable[_Union[_generate_pb2.ImagePatches, _Mapping]]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: WorkerRequest
    def __init__(self, request: _Optional[_Union[WorkerRequest, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("room", "prompt_tokens")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    room: int
    prompt_tokens: int
    def __init__(self, room: _Optional[int] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request", "prefill_bootstrap", "local_prefill")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BOOTSTRAP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    request: WorkerRequest
    prefill_bootstrap: str
    local_prefill: bool
    def __init__(self, request: _Optional[_Union[WorkerRequest, _Mapping]] = ..., prefill_bootstrap: _Optional[str] = ..., local_prefill: _Optional[bool] = ...) -> None: ...

class AbortRoomRequest(_message.Message):
    __slots__ = ("room", "reason")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    room: int
    reason: str
    def __init__(self, room: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortRoomResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("waiting_requests", "running_requests", "waiting_tokens", "kv_pages_used", "kv_pages_total", "rooms_active", "aux_slots_used", "bootstrap")
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROOMS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    AUX_SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_FIELD_NUMBER: _ClassVar[int]
    waiting_requests: int
    running_requests: int
    waiting_tokens: int
    kv_pages_used: int
    kv_pages_total: int
    rooms_active: int
    aux_slots_used: int
    bootstrap: str
    def __init__(self, waiting_requests: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_tokens: _Optional[int] = ..., kv_pages_used: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., rooms_active: _Optional[int] = ..., aux_slots_used: _Optional[int] = ..., bootstrap: _Optional[str] = ...) -> None: ...
