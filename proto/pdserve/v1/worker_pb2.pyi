from proto.pdserve.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRequest(_message.Message):
    __slots__ = ("room", "request_id", "token_ids", "images", "sampling", "videos", "resumed_tokens")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    room: int
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    images: _containers.RepeatedCompositeFieldContainer[_generate_pb2.ImagePatches]
    sampling: _generate_pb2.SamplingParams
    videos: _containers.RepeatedCompositeFieldContainer[_generate_pb2.Video]
    resumed_tokens: int
    def __init__(self, room: _Optional[int] = ..., request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., images: _Optional[_Iterable[_Union[_generate_pb2.ImagePatches, _Mapping]]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., videos: _Optional[_Iterable[_Union[_generate_pb2.Video, _Mapping]]] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: WorkerRequest
    def __init__(self, request: _Optional[_Union[WorkerRequest, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("room", "prompt_tokens", "prompt_logprobs", "prompt_top_logprobs")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    room: int
    prompt_tokens: int
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TopLogprobs]
    def __init__(self, room: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

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
    __slots__ = ("room", "reason", "request_id")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    room: int
    reason: str
    request_id: str
    def __init__(self, room: _Optional[int] = ..., reason: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class AbortRoomResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("waiting_requests", "running_requests", "waiting_tokens", "kv_pages_used", "kv_pages_total", "rooms_active", "aux_slots_used", "bootstrap", "instance_id", "page_size", "scores_prompts")
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROOMS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    AUX_SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    SCORES_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    waiting_requests: int
    running_requests: int
    waiting_tokens: int
    kv_pages_used: int
    kv_pages_total: int
    rooms_active: int
    aux_slots_used: int
    bootstrap: str
    instance_id: str
    page_size: int
    scores_prompts: bool
    def __init__(self, waiting_requests: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_tokens: _Optional[int] = ..., kv_pages_used: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., rooms_active: _Optional[int] = ..., aux_slots_used: _Optional[int] = ..., bootstrap: _Optional[str] = ..., instance_id: _Optional[str] = ..., page_size: _Optional[int] = ..., scores_prompts: _Optional[bool] = ...) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvBlockStored(_message.Message):
    __slots__ = ("block_hash", "parent_hash", "token_ids")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    parent_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KvBlocksRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KvCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("seq", "stored", "removed", "cleared")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stored: KvBlockStored
    removed: KvBlocksRemoved
    cleared: KvCleared
    def __init__(self, seq: _Optional[int] = ..., stored: _Optional[_Union[KvBlockStored, _Mapping]] = ..., removed: _Optional[_Union[KvBlocksRemoved, _Mapping]] = ..., cleared: _Optional[_Union[KvCleared, _Mapping]] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...

class StageRoom(_message.Message):
    __slots__ = ("room", "prompt_tokens", "sampling", "mrope_delta", "prompt_ids", "resumed_tokens")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MROPE_DELTA_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    room: int
    prompt_tokens: int
    sampling: _generate_pb2.SamplingParams
    mrope_delta: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    resumed_tokens: int
    def __init__(self, room: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., mrope_delta: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class StageItem(_message.Message):
    __slots__ = ("room", "start", "num_tokens", "needs_sample")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEEDS_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    room: int
    start: int
    num_tokens: int
    needs_sample: bool
    def __init__(self, room: _Optional[int] = ..., start: _Optional[int] = ..., num_tokens: _Optional[int] = ..., needs_sample: _Optional[bool] = ...) -> None: ...

class StageAbort(_message.Message):
    __slots__ = ("room", "reason")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    room: int
    reason: str
    def __init__(self, room: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class StageStep(_message.Message):
    __slots__ = ("new_rooms", "aborted", "items", "hidden", "mrope_positions", "aux")
    NEW_ROOMS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    MROPE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    AUX_FIELD_NUMBER: _ClassVar[int]
    new_rooms: _containers.RepeatedCompositeFieldContainer[StageRoom]
    aborted: _containers.RepeatedCompositeFieldContainer[StageAbort]
    items: _containers.RepeatedCompositeFieldContainer[StageItem]
    hidden: bytes
    mrope_positions: bytes
    aux: bytes
    def __init__(self, new_rooms: _Optional[_Iterable[_Union[StageRoom, _Mapping]]] = ..., aborted: _Optional[_Iterable[_Union[StageAbort, _Mapping]]] = ..., items: _Optional[_Iterable[_Union[StageItem, _Mapping]]] = ..., hidden: _Optional[bytes] = ..., mrope_positions: _Optional[bytes] = ..., aux: _Optional[bytes] = ...) -> None: ...

class StageSample(_message.Message):
    __slots__ = ("token", "logprob")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class StageStepReply(_message.Message):
    __slots__ = ("ready", "failed", "samples")
    READY_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ready: _containers.RepeatedScalarFieldContainer[int]
    failed: _containers.RepeatedCompositeFieldContainer[StageAbort]
    samples: _containers.RepeatedCompositeFieldContainer[StageSample]
    def __init__(self, ready: _Optional[_Iterable[int]] = ..., failed: _Optional[_Iterable[_Union[StageAbort, _Mapping]]] = ..., samples: _Optional[_Iterable[_Union[StageSample, _Mapping]]] = ...) -> None: ...

class DescribeStageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("pp_rank", "pp_size", "layer_start", "layer_end", "bootstrap", "draft_layer_ids", "aux_layer_ids")
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    AUX_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    pp_rank: int
    pp_size: int
    layer_start: int
    layer_end: int
    bootstrap: str
    draft_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    aux_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., bootstrap: _Optional[str] = ..., draft_layer_ids: _Optional[_Iterable[int]] = ..., aux_layer_ids: _Optional[_Iterable[int]] = ...) -> None: ...
