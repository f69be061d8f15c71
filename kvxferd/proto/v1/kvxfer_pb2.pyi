from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CacheStrides(_message.Message):
    __slots__ = ("content", "layer", "block", "head", "token")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    content: str
    layer: int
    block: int
    head: int
    token: int
    def __init__(self, content: _Optional[str] = ..., layer: _Optional[int] = ..., block: _Optional[int] = ..., head: _Optional[int] = ..., token: _Optional[int] = ...) -> None: ...

class AttentionCache(_message.Message):
    __slots__ = ("layout", "num_blocks", "num_kv_heads", "head_size", "block_size", "kernel_block_size", "dtype", "num_layers", "strides")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KERNEL_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    layout: str
    num_blocks: int
    num_kv_heads: int
    head_size: int
    block_size: int
    kernel_block_size: int
    dtype: str
    num_layers: int
    strides: CacheStrides
    def __init__(self, layout: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., block_size: _Optional[int] = ..., kernel_block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., strides: _Optional[_Union[CacheStrides, _Mapping]] = ...) -> None: ...

class StateCache(_message.Message):
    __slots__ = ("num_blocks", "num_heads", "head_dim", "num_groups", "state_size", "conv_window", "conv_dtype", "ssm_dtype", "conv_order", "page_bytes", "block_stride", "num_layers", "layer_stride", "conv_parts")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    STATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONV_WINDOW_FIELD_NUMBER: _ClassVar[int]
    CONV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SSM_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CONV_ORDER_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_STRIDE_FIELD_NUMBER: _ClassVar[int]
    CONV_PARTS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_window: int
    conv_dtype: str
    ssm_dtype: str
    conv_order: str
    page_bytes: int
    block_stride: int
    num_layers: int
    layer_stride: int
    conv_parts: str
    def __init__(self, num_blocks: _Optional[int] = ..., num_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., num_groups: _Optional[int] = ..., state_size: _Optional[int] = ..., conv_window: _Optional[int] = ..., conv_dtype: _Optional[str] = ..., ssm_dtype: _Optional[str] = ..., conv_order: _Optional[str] = ..., page_bytes: _Optional[int] = ..., block_stride: _Optional[int] = ..., num_layers: _Optional[int] = ..., layer_stride: _Optional[int] = ..., conv_parts: _Optional[str] = ...) -> None: ...

class MemoryHandle(_message.Message):
    __slots__ = ("shm_name", "cuda_ipc_handle", "cuda_vmm_fd_index", "shm_fd_index", "offset", "allocation_bytes", "shm_device", "shm_inode", "holder_pid", "holder_fd", "share_token", "share_socket", "rdma_capable")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CUDA_VMM_FD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHM_FD_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_DEVICE_FIELD_NUMBER: _ClassVar[int]
    SHM_INODE_FIELD_NUMBER: _ClassVar[int]
    HOLDER_PID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FD_FIELD_NUMBER: _ClassVar[int]
    SHARE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SHARE_SOCKET_FIELD_NUMBER: _ClassVar[int]
    RDMA_CAPABLE_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    cuda_ipc_handle: bytes
    cuda_vmm_fd_index: int
    shm_fd_index: int
    offset: int
    allocation_bytes: int
    shm_device: int
    shm_inode: int
    holder_pid: int
    holder_fd: int
    share_token: str
    share_socket: str
    rdma_capable: bool
    def __init__(self, shm_name: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ..., cuda_vmm_fd_index: _Optional[int] = ..., shm_fd_index: _Optional[int] = ..., offset: _Optional[int] = ..., allocation_bytes: _Optional[int] = ..., shm_device: _Optional[int] = ..., shm_inode: _Optional[int] = ..., holder_pid: _Optional[int] = ..., holder_fd: _Optional[int] = ..., share_token: _Optional[str] = ..., share_socket: _Optional[str] = ..., rdma_capable: _Optional[bool] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("handle", "address", "num_bytes", "device_id", "device_uuid")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    handle: MemoryHandle
    address: int
    num_bytes: int
    device_id: int
    device_uuid: str
    def __init__(self, handle: _Optional[_Union[MemoryHandle, _Mapping]] = ..., address: _Optional[int] = ..., num_bytes: _Optional[int] = ..., device_id: _Optional[int] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class CacheGroup(_message.Message):
    __slots__ = ("kind", "attention", "state", "regions")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    attention: AttentionCache
    state: StateCache
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    def __init__(self, kind: _Optional[str] = ..., attention: _Optional[_Union[AttentionCache, _Mapping]] = ..., state: _Optional[_Union[StateCache, _Mapping]] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ...) -> None: ...

class EngineRank(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "tp_size", "groups", "mem_type")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    tp_size: int
    groups: _containers.RepeatedCompositeFieldContainer[CacheGroup]
    mem_type: str
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[CacheGroup, _Mapping]]] = ..., mem_type: _Optional[str] = ...) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("engine", "lease_s", "fd_token", "allowed_reader_engine_ids", "process_fd_index")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    FD_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_READER_ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FD_INDEX_FIELD_NUMBER: _ClassVar[int]
    engine: EngineRank
    lease_s: float
    fd_token: str
    allowed_reader_engine_ids: _containers.RepeatedScalarFieldContainer[str]
    process_fd_index: int
    def __init__(self, engine: _Optional[_Union[EngineRank, _Mapping]] = ..., lease_s: _Optional[float] = ..., fd_token: _Optional[str] = ..., allowed_reader_engine_ids: _Optional[_Iterable[str]] = ..., process_fd_index: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("incarnation", "notify_address", "notify_last_seq", "peer_address", "session", "notify_curve_server_key")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NOTIFY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NOTIFY_LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NOTIFY_CURVE_SERVER_KEY_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    notify_address: str
    notify_last_seq: int
    peer_address: str
    session: str
    notify_curve_server_key: str
    def __init__(self, incarnation: _Optional[str] = ..., notify_address: _Optional[str] = ..., notify_last_seq: _Optional[int] = ..., peer_address: _Optional[str] = ..., session: _Optional[str] = ..., notify_curve_server_key: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class DeregisterReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("engine_id", "remote_engine_id", "peer_addresses")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    remote_engine_id: str
    peer_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine_id: _Optional[str] = ..., remote_engine_id: _Optional[str] = ..., peer_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("remote_tp_size", "duration_s")
    REMOTE_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    remote_tp_size: int
    duration_s: float
    def __init__(self, remote_tp_size: _Optional[int] = ..., duration_s: _Optional[float] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("request_id", "ok", "num_bytes", "num_descriptors", "duration_s", "invalid_block_ids", "error", "post_s", "done_unix_s", "failed_ranks", "seq", "refused_code", "plan_s", "transfer_s", "check_s", "failure")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    INVALID_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    POST_S_FIELD_NUMBER: _ClassVar[int]
    DONE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    FAILED_RANKS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REFUSED_CODE_FIELD_NUMBER: _ClassVar[int]
    PLAN_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    CHECK_S_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ok: bool
    num_bytes: int
    num_descriptors: int
    duration_s: float
    invalid_block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    error: str
    post_s: float
    done_unix_s: float
    failed_ranks: _containers.RepeatedScalarFieldContainer[int]
    seq: int
    refused_code: int
    plan_s: float
    transfer_s: float
    check_s: float
    failure: str
    def __init__(self, request_id: _Optional[str] = ..., ok: _Optional[bool] = ..., num_bytes: _Optional[int] = ..., num_descriptors: _Optional[int] = ..., duration_s: _Optional[float] = ..., invalid_block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., error: _Optional[str] = ..., post_s: _Optional[float] = ..., done_unix_s: _Optional[float] = ..., failed_ranks: _Optional[_Iterable[int]] = ..., seq: _Optional[int] = ..., refused_code: _Optional[int] = ..., plan_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., check_s: _Optional[float] = ..., failure: _Optional[str] = ...) -> None: ...

class ReadSpec(_message.Message):
    __slots__ = ("request_id", "remote_engine_id", "remote_request_id", "local_block_ids", "local_group_sizes", "remote_block_ids", "remote_group_sizes", "num_tokens", "deadline_s", "resend", "remote_capabilities", "push", "push_key", "remote_digests", "traceparent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_GROUP_SIZES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_GROUP_SIZES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    RESEND_FIELD_NUMBER: _ClassVar[int]
    REMOTE_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PUSH_KEY_FIELD_NUMBER: _ClassVar[int]
    REMOTE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    remote_engine_id: str
    remote_request_id: str
    local_block_ids: bytes
    local_group_sizes: _containers.RepeatedScalarFieldContainer[int]
    remote_block_ids: bytes
    remote_group_sizes: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    deadline_s: float
    resend: bool
    remote_capabilities: _containers.RepeatedScalarFieldContainer[bytes]
    push: bool
    push_key: bytes
    remote_digests: _containers.RepeatedScalarFieldContainer[bytes]
    traceparent: str
    def __init__(self, request_id: _Optional[str] = ..., remote_engine_id: _Optional[str] = ..., remote_request_id: _Optional[str] = ..., local_block_ids: _Optional[bytes] = ..., local_group_sizes: _Optional[_Iterable[int]] = ..., remote_block_ids: _Optional[bytes] = ..., remote_group_sizes: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., deadline_s: _Optional[float] = ..., resend: _Optional[bool] = ..., remote_capabilities: _Optional[_Iterable[bytes]] = ..., push: _Optional[bool] = ..., push_key: _Optional[bytes] = ..., remote_digests: _Optional[_Iterable[bytes]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class ReadBatch(_message.Message):
    __slots__ = ("engine_id", "reads", "ack_seq", "session", "holds", "control", "renewals", "releases", "final_layers")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    ACK_SEQ_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    HOLDS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    RENEWALS_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    FINAL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    reads: _containers.RepeatedCompositeFieldContainer[ReadSpec]
    ack_seq: int
    session: str
    holds: _containers.RepeatedCompositeFieldContainer[HoldRequest]
    control: bool
    renewals: _containers.RepeatedCompositeFieldContainer[RenewLeaseRequest]
    releases: _containers.RepeatedCompositeFieldContainer[ReleaseRequest]
    final_layers: _containers.RepeatedCompositeFieldContainer[FinalLayersRequest]
    def __init__(self, engine_id: _Optional[str] = ..., reads: _Optional[_Iterable[_Union[ReadSpec, _Mapping]]] = ..., ack_seq: _Optional[int] = ..., session: _Optional[str] = ..., holds: _Optional[_Iterable[_Union[HoldRequest, _Mapping]]] = ..., control: _Optional[bool] = ..., renewals: _Optional[_Iterable[_Union[RenewLeaseRequest, _Mapping]]] = ..., releases: _Optional[_Iterable[_Union[ReleaseRequest, _Mapping]]] = ..., final_layers: _Optional[_Iterable[_Union[FinalLayersRequest, _Mapping]]] = ...) -> None: ...

class CompletionBatch(_message.Message):
    __slots__ = ("completions", "end_code", "end_message", "holds", "renewals")
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    END_CODE_FIELD_NUMBER: _ClassVar[int]
    END_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HOLDS_FIELD_NUMBER: _ClassVar[int]
    RENEWALS_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    end_code: int
    end_message: str
    holds: _containers.RepeatedCompositeFieldContainer[HoldAnswer]
    renewals: _containers.RepeatedCompositeFieldContainer[LeaseAnswer]
    def __init__(self, completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., end_code: _Optional[int] = ..., end_message: _Optional[str] = ..., holds: _Optional[_Iterable[_Union[HoldAnswer, _Mapping]]] = ..., renewals: _Optional[_Iterable[_Union[LeaseAnswer, _Mapping]]] = ...) -> None: ...

class LeaseAnswer(_message.Message):
    __slots__ = ("unknown_request_ids", "code", "error")
    UNKNOWN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    unknown_request_ids: _containers.RepeatedScalarFieldContainer[str]
    code: int
    error: str
    def __init__(self, unknown_request_ids: _Optional[_Iterable[str]] = ..., code: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class HoldAnswer(_message.Message):
    __slots__ = ("request_id", "incarnation", "code", "error", "capability", "digests")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    incarnation: str
    code: int
    error: str
    capability: bytes
    digests: bytes
    def __init__(self, request_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., code: _Optional[int] = ..., error: _Optional[str] = ..., capability: _Optional[bytes] = ..., digests: _Optional[bytes] = ...) -> None: ...

class HoldRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "block_ids", "lease_s", "push_key_digest", "layers_final", "want_digests", "traceparent")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    PUSH_KEY_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FINAL_FIELD_NUMBER: _ClassVar[int]
    WANT_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    lease_s: float
    push_key_digest: bytes
    layers_final: _containers.RepeatedScalarFieldContainer[int]
    want_digests: bool
    traceparent: str
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., lease_s: _Optional[float] = ..., push_key_digest: _Optional[bytes] = ..., layers_final: _Optional[_Iterable[int]] = ..., want_digests: _Optional[bool] = ..., traceparent: _Optional[str] = ...) -> None: ...

class HoldReply(_message.Message):
    __slots__ = ("incarnation", "capability", "digests")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    capability: bytes
    digests: bytes
    def __init__(self, incarnation: _Optional[str] = ..., capability: _Optional[bytes] = ..., digests: _Optional[bytes] = ...) -> None: ...

class FinalLayersRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "layers_final")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FINAL_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    layers_final: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., layers_final: _Optional[_Iterable[int]] = ...) -> None: ...

class FinalLayersReply(_message.Message):
    __slots__ = ("final",)
    FINAL_FIELD_NUMBER: _ClassVar[int]
    final: bool
    def __init__(self, final: _Optional[bool] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("engine_id", "request_ids", "lease_s")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_s: float
    def __init__(self, engine_id: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ..., lease_s: _Optional[float] = ...) -> None: ...

class RenewLeaseReply(_message.Message):
    __slots__ = ("unknown_request_ids",)
    UNKNOWN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    unknown_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, unknown_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("engine_id", "request_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NotifyEvent(_message.Message):
    __slots__ = ("seq", "engine_id", "request_id", "kind", "block_ids", "reason")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[NotifyEvent.Kind]
        CONSUMED: _ClassVar[NotifyEvent.Kind]
        EXPIRED: _ClassVar[NotifyEvent.Kind]
        FAILED: _ClassVar[NotifyEvent.Kind]
    KIND_UNSPECIFIED: NotifyEvent.Kind
    CONSUMED: NotifyEvent.Kind
    EXPIRED: NotifyEvent.Kind
    FAILED: NotifyEvent.Kind
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    engine_id: str
    request_id: str
    kind: NotifyEvent.Kind
    block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    reason: str
    def __init__(self, seq: _Optional[int] = ..., engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., kind: _Optional[_Union[NotifyEvent.Kind, str]] = ..., block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., reason: _Optional[str] = ...) -> None: ...

class MissedEventsRequest(_message.Message):
    __slots__ = ("engine_id", "after_seq")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    after_seq: int
    def __init__(self, engine_id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class MissedEventsReply(_message.Message):
    __slots__ = ("events", "last_seq", "truncated")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[NotifyEvent]
    last_seq: int
    truncated: bool
    def __init__(self, events: _Optional[_Iterable[_Union[NotifyEvent, _Mapping]]] = ..., last_seq: _Optional[int] = ..., truncated: _Optional[bool] = ...) -> None: ...

class EngineInfoRequest(_message.Message):
    __slots__ = ("engine_id", "protocol_version", "tp_rank", "reader_engine_id", "reader_tp_rank", "reader_agent_metadata", "reader_tp_size", "same_host_token", "reader_target")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    READER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    READER_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    READER_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    READER_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    READER_TARGET_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    protocol_version: int
    tp_rank: int
    reader_engine_id: str
    reader_tp_rank: int
    reader_agent_metadata: bytes
    reader_tp_size: int
    same_host_token: str
    reader_target: EngineInfoReply
    def __init__(self, engine_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., tp_rank: _Optional[int] = ..., reader_engine_id: _Optional[str] = ..., reader_tp_rank: _Optional[int] = ..., reader_agent_metadata: _Optional[bytes] = ..., reader_tp_size: _Optional[int] = ..., same_host_token: _Optional[str] = ..., reader_target: _Optional[_Union[EngineInfoReply, _Mapping]] = ...) -> None: ...

class EngineInfoReply(_message.Message):
    __slots__ = ("protocol_version", "compatibility_hash", "payload")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    compatibility_hash: str
    payload: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., compatibility_hash: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("incarnation", "agent_metadata", "engine", "hold_board", "hold_key", "same_host_proof", "writer_agent_name")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    HOLD_BOARD_FIELD_NUMBER: _ClassVar[int]
    HOLD_KEY_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_PROOF_FIELD_NUMBER: _ClassVar[int]
    WRITER_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    agent_metadata: bytes
    engine: EngineRank
    hold_board: HoldBoard
    hold_key: bytes
    same_host_proof: str
    writer_agent_name: str
    def __init__(self, incarnation: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., engine: _Optional[_Union[EngineRank, _Mapping]] = ..., hold_board: _Optional[_Union[HoldBoard, _Mapping]] = ..., hold_key: _Optional[bytes] = ..., same_host_proof: _Optional[str] = ..., writer_agent_name: _Optional[str] = ...) -> None: ...

class HoldBoard(_message.Message):
    __slots__ = ("address", "num_buckets", "share")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    address: int
    num_buckets: int
    share: MemoryHandle
    def __init__(self, address: _Optional[int] = ..., num_buckets: _Optional[int] = ..., share: _Optional[_Union[MemoryHandle, _Mapping]] = ...) -> None: ...

class ChallengeRequest(_message.Message):
    __slots__ = ("protocol_version", "client_nonce")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NONCE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    client_nonce: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., client_nonce: _Optional[bytes] = ...) -> None: ...

class ChallengeReply(_message.Message):
    __slots__ = ("protocol_version", "server_nonce", "proof", "certificate")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_NONCE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    server_nonce: bytes
    proof: bytes
    certificate: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., server_nonce: _Optional[bytes] = ..., proof: _Optional[bytes] = ..., certificate: _Optional[bytes] = ...) -> None: ...

class IncarnationRequest(_message.Message):
    __slots__ = ("engine_id", "reader_engine_id", "reader_tp_rank")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    READER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    READER_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    reader_engine_id: str
    reader_tp_rank: int
    def __init__(self, engine_id: _Optional[str] = ..., reader_engine_id: _Optional[str] = ..., reader_tp_rank: _Optional[int] = ...) -> None: ...

class IncarnationReply(_message.Message):
    __slots__ = ("incarnation", "reader_known")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    READER_KNOWN_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    reader_known: bool
    def __init__(self, incarnation: _Optional[str] = ..., reader_known: _Optional[bool] = ...) -> None: ...
