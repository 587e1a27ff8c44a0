from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Stats(_message.Message):
    __slots__ = ("role", "kv_pages_used", "kv_pages_total", "aux_slots_used", "aux_slots_total", "rooms_active", "requests_running", "requests_waiting", "waiting_tokens", "requests_total", "requests_rejected", "transfers_failed", "drafted_tokens", "accepted_tokens", "spec_rounds", "acceptance_length", "faults_injected", "kv_retries", "kv_recomputes", "decode_failovers", "kv_pages_cached", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "prefix_cache_hit_rate", "prefix_cache_evicted_blocks", "kv_pages_not_sent", "kv_bytes_not_sent", "state_slots_used", "state_slots_total", "state_checkpoints_total", "state_checkpoints_cached", "state_checkpoint_bytes", "state_checkpoints_saved", "state_checkpoints_restored", "state_checkpoints_evicted")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    AUX_SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    AUX_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROOMS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FAILED_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FAULTS_INJECTED_FIELD_NUMBER: _ClassVar[int]
    KV_RETRIES_FIELD_NUMBER: _ClassVar[int]
    KV_RECOMPUTES_FIELD_NUMBER: _ClassVar[int]
    DECODE_FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_NOT_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_NOT_SENT_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STATE_CHECKPOINTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STATE_CHECKPOINTS_CACHED_FIELD_NUMBER: _ClassVar[int]
    STATE_CHECKPOINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_CHECKPOINTS_SAVED_FIELD_NUMBER: _ClassVar[int]
    STATE_CHECKPOINTS_RESTORED_FIELD_NUMBER: _ClassVar[int]
    STATE_CHECKPOINTS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    role: str
    kv_pages_used: int
    kv_pages_total: int
    aux_slots_used: int
    aux_slots_total: int
    rooms_active: int
    requests_running: int
    requests_waiting: int
    waiting_tokens: int
    requests_total: int
    requests_rejected: int
    transfers_failed: int
    drafted_tokens: int
    accepted_tokens: int
    spec_rounds: int
    acceptance_length: float
    faults_injected: int
    kv_retries: int
    kv_recomputes: int
    decode_failovers: int
    kv_pages_cached: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_hit_rate: float
    prefix_cache_evicted_blocks: int
    kv_pages_not_sent: int
    kv_bytes_not_sent: int
    state_slots_used: int
    state_slots_total: int
    state_checkpoints_total: int
    state_checkpoints_cached: int
    state_checkpoint_bytes: int
    state_checkpoints_saved: int
    state_checkpoints_restored: int
    state_checkpoints_evicted: int
    def __init__(self, role: _Optional[str] = ..., kv_pages_used: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., aux_slots_used: _Optional[int] = ..., aux_slots_total: _Optional[int] = ..., rooms_active: _Optional[int] = ..., requests_running: _Optional[int] = ..., requests_waiting: _Optional[int] = ..., waiting_tokens: _Optional[int] = ..., requests_total: _Optional[int] = ..., requests_rejected: _Optional[int] = ..., transfers_failed: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., spec_rounds: _Optional[int] = ..., acceptance_length: _Optional[float] = ..., faults_injected: _Optional[int] = ..., kv_retries: _Optional[int] = ..., kv_recomputes: _Optional[int] = ..., decode_failovers: _Optional[int] = ..., kv_pages_cached: _Optional[int] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., prefix_cache_evicted_blocks: _Optional[int] = ..., kv_pages_not_sent: _Optional[int] = ..., kv_bytes_not_sent: _Optional[int] = ..., state_slots_used: _Optional[int] = ..., state_slots_total: _Optional[int] = ..., state_checkpoints_total: _Optional[int] = ..., state_checkpoints_cached: _Optional[int] = ..., state_checkpoint_bytes: _Optional[int] = ..., state_checkpoints_saved: _Optional[int] = ..., state_checkpoints_restored: _Optional[int] = ..., state_checkpoints_evicted: _Optional[int] = ...) -> None: ...
