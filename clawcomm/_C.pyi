"""Type stub for ``clawcomm._C``: the engine, its kernels and codecs, built
without torch (csrc/python/). ``kernels``, ``compress`` (and ``cuda`` in CUDA
builds) are submodules at run time; they are written as classes of static
functions here so that one stub file covers the module. Regenerate with
``python3 .ci/gen_stub.py`` after changing the bindings; tests/test_engine.py
checks that every public name is here.
"""

from __future__ import annotations

import typing

import numpy
import numpy.typing
import typing_extensions

class compress:
    """The ``clawcomm._C.compress`` submodule: Sparsification kernels for gradient compression."""

    @staticmethod
    def decode_indices(
        data: bytes, count: typing.SupportsInt | typing.SupportsIndex
    ) -> numpy.typing.NDArray[numpy.int32]:
        """
        The inverse of encode_indices.
        """
    @staticmethod
    def decode_rans(
        data: numpy.typing.NDArray[numpy.uint8], count: typing.SupportsInt | typing.SupportsIndex
    ) -> numpy.typing.NDArray[numpy.uint8]:
        """
        The inverse of encode_rans: `count` bytes from a uint8 array.
        """
    @staticmethod
    def decode_rice(
        data: bytes, count: typing.SupportsInt | typing.SupportsIndex
    ) -> numpy.typing.NDArray[numpy.int32]:
        """
        The inverse of encode_rice.
        """
    @staticmethod
    def dequantize(
        codes: typing.SupportsInt | typing.SupportsIndex,
        scales: typing.SupportsInt | typing.SupportsIndex,
        out: typing.SupportsInt | typing.SupportsIndex,
        n: typing.SupportsInt | typing.SupportsIndex,
        bits: typing.SupportsInt | typing.SupportsIndex,
        block: typing.SupportsInt | typing.SupportsIndex,
        scale: str = "max",
        alpha: typing.SupportsFloat | typing.SupportsIndex = 1.0,
        accumulate: bool = False,
        stream: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> None:
        """
        out = alpha * decoded, or out += alpha * decoded (accumulate).
        """
    @staticmethod
    def encode16_feedback(
        grad: numpy.typing.NDArray[numpy.float32],
        residual: numpy.typing.NDArray[numpy.float32],
        payload: numpy.ndarray,
        dtype: str = "float16",
        scale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
    ) -> None:
        """
        Error feedback with a 16-bit payload in one pass: acc = grad + residual, payload = round16(acc * scale), residual = acc - widen(payload) / scale.
        """
    @staticmethod
    def encode_indices(idx: numpy.typing.NDArray[numpy.int32]) -> bytes:
        """
        Delta + LEB128 varint bytes of ascending int32 indices.
        """
    @staticmethod
    def encode_rans(data: numpy.typing.NDArray[numpy.uint8]) -> bytes:
        """
        rANS bytes of a uint8 array, with its frequency table (compress/rans.h).
        """
    @staticmethod
    def encode_rice(idx: numpy.typing.NDArray[numpy.int32]) -> bytes:
        """
        Golomb-Rice bytes of strictly ascending int32 indices, with the parameter that makes them shortest (compress/rice.h).
        """
    @staticmethod
    def scatter_add(
        dense: numpy.typing.NDArray[numpy.float32],
        idx: numpy.typing.NDArray[numpy.int32],
        val: numpy.typing.NDArray[numpy.float32],
        scale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
    ) -> None:
        """
        dense[idx[i]] += val[i] * scale (indices are checked).
        """
    @staticmethod
    def threshold_scan(
        acc: numpy.typing.NDArray[numpy.float32],
        threshold: typing.SupportsFloat | typing.SupportsIndex,
        grad: typing.Any = None,
        level: typing.Any = None,
    ) -> tuple[numpy.typing.NDArray[numpy.int32], numpy.typing.NDArray[numpy.float32]]:
        """
        The pass behind top-k (compress/threshold_scan.h), for tests: entries of `acc` (or of grad + acc, folding grad into acc and zeroing grad) with magnitude >= threshold, as (indices, values); they are zeroed in `acc`.
        """
    @staticmethod
    def quantize(
        x: numpy.typing.NDArray[numpy.float32],
        codes: numpy.typing.NDArray[numpy.uint8],
        scales: numpy.typing.NDArray[numpy.float32],
        bits: typing.SupportsInt | typing.SupportsIndex,
        block: typing.SupportsInt | typing.SupportsIndex,
        scale: str = "max",
        stochastic: bool = True,
        seed: typing.SupportsInt | typing.SupportsIndex = 0,
        residual: typing.Any = None,
    ) -> None:
        """
        Block quantisation (compress/quantize.h): x as `bits`-bit codes and one float32 scale per block; with a residual, x + residual is quantised and the residual keeps what the codes miss.
        """
    @staticmethod
    def topk(
        acc: numpy.typing.NDArray[numpy.float32],
        k: typing.SupportsInt | typing.SupportsIndex,
        method: str = "sampled",
        seed: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> tuple[numpy.typing.NDArray[numpy.int32], numpy.typing.NDArray[numpy.float32]]:
        """
        Selects (at most) k entries of largest magnitude from the float32 array `acc`, returns (indices ascending as int32, values), and zeroes them in `acc`, which keeps the residual.
        """
    @staticmethod
    def topk_feedback(
        grad: numpy.typing.NDArray[numpy.float32],
        residual: numpy.typing.NDArray[numpy.float32],
        k: typing.SupportsInt | typing.SupportsIndex,
        method: str = "sampled",
        seed: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> tuple[numpy.typing.NDArray[numpy.int32], numpy.typing.NDArray[numpy.float32]]:
        """
        Top-k with error feedback in one pass: selects (at most) k entries of largest magnitude of grad + residual and returns (indices ascending as int32, values); `residual` becomes what was not sent and `grad` is zeroed.
        """

class cuda:
    """The ``clawcomm._C.cuda`` submodule: The CUDA kernels on device pointers (integers), asynchronous on `stream`."""

    @staticmethod
    def add_from16(
        dst: typing.SupportsInt | typing.SupportsIndex,
        src: typing.SupportsInt | typing.SupportsIndex,
        count: typing.SupportsInt | typing.SupportsIndex,
        dtype: str = "float16",
        dst_scale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
        stream: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> None: ...
    @staticmethod
    def add_from16_and_round(
        dst: typing.SupportsInt | typing.SupportsIndex,
        src: typing.SupportsInt | typing.SupportsIndex,
        out: typing.SupportsInt | typing.SupportsIndex,
        count: typing.SupportsInt | typing.SupportsIndex,
        dtype: str = "float16",
        dst_scale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
        out_scale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
        stream: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> None: ...
    @staticmethod
    def dequantize(
        codes: numpy.typing.NDArray[numpy.uint8],
        scales: numpy.typing.NDArray[numpy.float32],
        out: numpy.typing.NDArray[numpy.float32],
        bits: typing.SupportsInt | typing.SupportsIndex,
        block: typing.SupportsInt | typing.SupportsIndex,
        scale: str = "max",
        alpha: typing.SupportsFloat | typing.SupportsIndex = 1.0,
        accumulate: bool = False,
    ) -> None:
        """
        out = alpha * decoded codes, or out += that (accumulate).
        """
    @staticmethod
    def encode16_feedback(
        grad: typing.SupportsInt | typing.SupportsIndex,
        residual: typing.SupportsInt | typing.SupportsIndex,
        payload: typing.SupportsInt | typing.SupportsIndex,
        count: typing.SupportsInt | typing.SupportsIndex,
        dtype: str = "float16",
        scale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
        stream: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> None: ...
    @staticmethod
    def from_float32(
        src: typing.SupportsInt | typing.SupportsIndex,
        dst: typing.SupportsInt | typing.SupportsIndex,
        count: typing.SupportsInt | typing.SupportsIndex,
        dtype: str = "float16",
        scale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
        stream: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> None: ...
    @staticmethod
    def quantize(
        x: typing.SupportsInt | typing.SupportsIndex,
        codes: typing.SupportsInt | typing.SupportsIndex,
        scales: typing.SupportsInt | typing.SupportsIndex,
        n: typing.SupportsInt | typing.SupportsIndex,
        bits: typing.SupportsInt | typing.SupportsIndex,
        block: typing.SupportsInt | typing.SupportsIndex,
        scale: str = "max",
        stochastic: bool = True,
        seed: typing.SupportsInt | typing.SupportsIndex = 0,
        residual: typing.SupportsInt | typing.SupportsIndex = 0,
        stream: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> None:
        """
        Block quantisation (compress/quantize.h) of n floats into n * bits / 8 bytes of codes and n / block scales; residual 0: no error feedback. The CPU's bits for the same seed.
        """
    @staticmethod
    def reduce(
        dst: typing.SupportsInt | typing.SupportsIndex,
        src: typing.SupportsInt | typing.SupportsIndex,
        count: typing.SupportsInt | typing.SupportsIndex,
        dtype: str = "float32",
        op: str = "sum",
        stream: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> None:
        """
        dst[i] = dst[i] op src[i].
        """
    @staticmethod
    def scatter_add(
        dense: typing.SupportsInt | typing.SupportsIndex,
        n: typing.SupportsInt | typing.SupportsIndex,
        idx: typing.SupportsInt | typing.SupportsIndex,
        val: typing.SupportsInt | typing.SupportsIndex,
        m: typing.SupportsInt | typing.SupportsIndex,
        scale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
        deterministic: bool = False,
        workspace: typing.SupportsInt | typing.SupportsIndex = 0,
        stream: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> None:
        """
        dense[idx[i]] += val[i] * scale; deterministic=True sorts by index first (needs scatter_add_workspace_bytes(m) of workspace) and gives the CPU's bits.
        """
    @staticmethod
    def scatter_add_workspace_bytes(m: typing.SupportsInt | typing.SupportsIndex) -> int: ...
    @staticmethod
    def to_float32(
        src: typing.SupportsInt | typing.SupportsIndex,
        dst: typing.SupportsInt | typing.SupportsIndex,
        count: typing.SupportsInt | typing.SupportsIndex,
        dtype: str = "float16",
        scale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
        stream: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> None: ...
    @staticmethod
    def topk_feedback(
        grad: typing.SupportsInt | typing.SupportsIndex,
        residual: typing.SupportsInt | typing.SupportsIndex,
        n: typing.SupportsInt | typing.SupportsIndex,
        k: typing.SupportsInt | typing.SupportsIndex,
        idx: typing.SupportsInt | typing.SupportsIndex,
        val: typing.SupportsInt | typing.SupportsIndex,
        count: typing.SupportsInt | typing.SupportsIndex,
        workspace: typing.SupportsInt | typing.SupportsIndex,
        method: str = "sampled",
        seed: typing.SupportsInt | typing.SupportsIndex = 0,
        stream: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> None:
        """
        Top-k with error feedback (grad may be 0: select from residual alone); the number selected lands in `count` (a device uint32).
        """
    @staticmethod
    def topk_workspace_bytes(n: typing.SupportsInt | typing.SupportsIndex) -> int: ...

class kernels:
    """The ``clawcomm._C.kernels`` submodule: The engine's element-wise kernels, for tests and micro-benchmarks."""

    @staticmethod
    def add_from16(
        dst: typing_extensions.Buffer,
        src: typing_extensions.Buffer,
        dtype: str = "float16",
        level: typing.Any = None,
        dst_scale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
    ) -> None:
        """
        dst = dst * dst_scale + widen(src): the 16-bit ring's decode-and-accumulate step.
        """
    @staticmethod
    def add_from16_and_round(
        dst: typing_extensions.Buffer,
        src: typing_extensions.Buffer,
        out: typing_extensions.Buffer,
        dtype: str = "float16",
        level: typing.Any = None,
        dst_scale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
        out_scale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
    ) -> None:
        """
        add_from16, then out = round16(dst) and dst = widen(out) * out_scale: the 16-bit ring's last reduce-scatter step.
        """
    @staticmethod
    def best_simd_level() -> str:
        """
        The best SIMD level this CPU supports.
        """
    @staticmethod
    def from_float32(
        src: typing_extensions.Buffer,
        dst: typing_extensions.Buffer,
        dtype: str = "float16",
        level: typing.Any = None,
        scale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
    ) -> None:
        """
        Rounds float32 times `scale` to 16-bit floats (nearest even).
        """
    @staticmethod
    def reduce(
        dst: typing_extensions.Buffer,
        src: typing_extensions.Buffer,
        op: str = "sum",
        level: typing.Any = None,
        dtype: typing.Any = None,
    ) -> None:
        """
        dst[i] = dst[i] op src[i].
        """
    @staticmethod
    def simd_level() -> str:
        """
        The SIMD level the engine uses (CLAWCOMM_SIMD caps it).
        """
    @staticmethod
    def to_float32(
        src: typing_extensions.Buffer,
        dst: typing_extensions.Buffer,
        dtype: str = "float16",
        level: typing.Any = None,
        scale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
    ) -> None:
        """
        Widens 16-bit floats (held in a uint16 or float16 buffer) into a float32 buffer, times `scale`.
        """

class Engine:
    """
    A communicator's collectives on buffer-protocol objects, below torch's dispatch. Every call blocks until the operation is complete on this rank.
    """
    def abort(self, reason: str = "abort() was called") -> None:
        """
        From any thread: fails the operation in flight and every later one with 'rank R aborted: reason', wakes every waiter and tells the peers; the process goes on.
        """
    def all_gather(
        self,
        input: typing_extensions.Buffer,
        output: typing_extensions.Buffer,
        dtype: typing.Any = None,
    ) -> None: ...
    def all_reduce(
        self, buf: typing_extensions.Buffer, op: str = "sum", dtype: typing.Any = None
    ) -> None:
        """
        In place, over every rank.
        """
    def all_reduce_16bit_wire(
        self,
        buf: typing_extensions.Buffer,
        wire: str = "float16",
        prescale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
        postscale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
    ) -> None:
        """
        Sum of a float32 buffer with float16 or bfloat16 on the wire and float32 accumulation at every step; values are multiplied by `prescale` first and the result by `postscale`, inside the conversion kernels.
        """
    def all_to_all(
        self,
        input: typing_extensions.Buffer,
        output: typing_extensions.Buffer,
        dtype: typing.Any = None,
        send_counts: list[int] | None = None,
        recv_counts: list[int] | None = None,
    ) -> None:
        """
        send_counts[p] elements of input go to rank p, recv_counts[p] from rank p land in output, each in rank order; neither: an even split
        """
    def barrier(self) -> None: ...
    def broadcast(
        self,
        buf: typing_extensions.Buffer,
        root: typing.SupportsInt | typing.SupportsIndex = 0,
        dtype: typing.Any = None,
    ) -> None: ...
    def comm_stats(self) -> dict:
        """
        Calls and bytes on the wire so far, per operation: whole frames (bytes_*) and payload only (payload_bytes_*); frames_*_single_copy: those whose payload the receiver read straight from the sender's memory (CLAWCOMM_SINGLE_COPY).
        """
    def end_estimate(self) -> float:
        """
        The cost model's time, in seconds, for the operations since start_estimate().
        """
    def flight_record(self) -> str:
        """
        The last operations of this communicator, oldest first, as JSON (the flight recorder; CLAWCOMM_RECORDER_ENTRIES sizes it).
        """
    def memory_stats(self) -> dict:
        """
        Memory this communicator holds outside torch's allocators: shm_ring_bytes, the shared-memory rings this rank reads, and shm_ring_resident_bytes of them in memory now; scratch_bytes, the collectives' working memory; device_ipc_bytes, the device memory of its CUDA IPC buffers on this rank (each device's, from its first call through CUDA IPC; CLAWCOMM_CUDA_IPC_BYTES, CLAWCOMM_CUDA_GRAPH_BYTES and CLAWCOMM_CUDA_P2P_BYTES size them); suspended (suspend()).
        """
    def recv(
        self,
        buf: typing_extensions.Buffer,
        src: typing.SupportsInt | typing.SupportsIndex = -1,
        tag: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> int:
        """
        Returns the rank the message came from (src=-1: any rank).
        """
    def reduce(
        self,
        buf: typing_extensions.Buffer,
        root: typing.SupportsInt | typing.SupportsIndex = 0,
        op: str = "sum",
        dtype: typing.Any = None,
    ) -> None: ...
    def reduce_scatter(
        self,
        input: typing_extensions.Buffer,
        output: typing_extensions.Buffer,
        op: str = "sum",
        dtype: typing.Any = None,
    ) -> None: ...
    def reduce_scatter_16bit_wire(
        self,
        buf: typing_extensions.Buffer,
        out: typing_extensions.Buffer,
        wire: str = "float16",
        prescale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
        postscale: typing.SupportsFloat | typing.SupportsIndex = 1.0,
    ) -> None:
        """
        Reduce-scatter of a float32 buffer (its length a multiple of the group's size) with float16 or bfloat16 on the wire and float32 accumulation: rank r's part into `out`. `buf` is overwritten with partial sums. `prescale` multiplies the values first, `postscale` the result.
        """
    def send(
        self,
        buf: typing_extensions.Buffer,
        dst: typing.SupportsInt | typing.SupportsIndex,
        tag: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> None: ...
    def sendrecv(
        self,
        send_buf: typing_extensions.Buffer,
        dst: typing.SupportsInt | typing.SupportsIndex,
        recv_buf: typing_extensions.Buffer,
        src: typing.SupportsInt | typing.SupportsIndex,
        tag: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> None:
        """
        Sends to `dst` while receiving from `src`.
        """
    def single_copy_from(self, peer: typing.SupportsInt | typing.SupportsIndex) -> int | None:
        """
        The smallest payload in bytes this rank sends to `peer` by single copy, or None
        """
    def resume(self) -> None:
        """
        Ends suspend(): operations run again.
        """
    def shrink(
        self,
        excluded: list[int],
        abort: bool = False,
        timeout: typing.SupportsFloat | typing.SupportsIndex = 0.0,
    ) -> Engine:
        """
        A new engine of this one's ranks but `excluded` (which may be dead or stuck in a collective), in this one's order, connected afresh through the store: only the ranks that stay call it, each with the same list. abort=True aborts this engine first, failing what it has in flight. timeout: seconds for the setup and the new engine's operations (0: this one's).
        """
    def split(
        self,
        color: typing.SupportsInt | typing.SupportsIndex,
        key: typing.Any = None,
        timeout: typing.SupportsFloat | typing.SupportsIndex = 0.0,
    ) -> Engine | None:
        """
        A new engine of the ranks that pass the same color (>= 0), ordered by key (default: this rank), set up over this engine's connections: every rank of this engine calls it, in the same order among its collectives; color=-1 joins none and returns None. timeout: seconds for the setup and the new engine's operations (0: this one's).
        """
    def start_estimate(self) -> None:
        """
        Until end_estimate(), this engine's operations move nothing and touch no buffer: each completes at once and the cost model prices it (torch's _time_estimator).
        """
    def suspend(self) -> None:
        """
        Frees the shared-memory rings' pages and the working memory between phases of a job, keeping the connections: every rank calls it, with no operation in flight. Operations are refused until resume().
        """
    def transport_of(self, peer: typing.SupportsInt | typing.SupportsIndex) -> str: ...
    @property
    def flight_record_path(self) -> str:
        """
        Where this communicator writes its flight record if it fails.
        """
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...

class HostGraph:
    """
    Calls captured by HostDeviceComm.begin_capture(), replayed in order.
    """
    def replay(self) -> None: ...

class HostWork:
    """
    A collective HostDeviceComm issued with async_op set, as torch's Work.
    """
    def wait(self, timeout: typing.SupportsFloat | typing.SupportsIndex | None = None) -> str:
        """
        Waits (at most `timeout` seconds) and returns the route it took; TimeoutError if it is still running then.
        """
    def is_completed(self) -> bool: ...
    @property
    def route(self) -> str: ...

class HostReceive:
    """
    A receive HostDeviceComm.irecv() posted.
    """
    def wait(self) -> str:
        """
        Waits for the message and copies it into the buffer; returns the route it took.
        """

class HostDeviceComm:
    """
    The device collectives of an Engine over the host runtime: the CUDA IPC path's setup, routing, kernels' protocol, abort and failure reports, run on the CPU. `device` is the device index this rank claims; `fault` ('none', 'alloc', 'open', 'probe') fails this rank's IPC setup on purpose. Each call returns the route it took ('ipc' or 'staged'); with async_op=True (on the communicator's stream) or False (on the caller's, not waited for) a collective returns a HostWork instead, as torch's adapter issues them.
    """
    def __init__(
        self,
        engine: Engine,
        device: typing.SupportsInt | typing.SupportsIndex = 0,
        fault: str = "none",
    ) -> None: ...
    def abort(self) -> None:
        """
        From any thread: stops this rank's spinning blocks and tells its peers' blocks.
        """
    def all_gather(
        self,
        input: typing_extensions.Buffer,
        output: typing_extensions.Buffer,
        dtype: typing.Any = None,
        async_op: bool | None = None,
    ) -> str | HostWork: ...
    def all_reduce(
        self,
        buf: typing_extensions.Buffer,
        op: str = "sum",
        dtype: typing.Any = None,
        async_op: bool | None = None,
    ) -> str | HostWork: ...
    def all_to_all(
        self,
        input: typing_extensions.Buffer,
        output: typing_extensions.Buffer,
        dtype: typing.Any = None,
        async_op: bool | None = None,
    ) -> str | HostWork: ...
    def begin_capture(self) -> None: ...
    def broadcast(
        self,
        buf: typing_extensions.Buffer,
        root: typing.SupportsInt | typing.SupportsIndex = 0,
        dtype: typing.Any = None,
        async_op: bool | None = None,
    ) -> str | HostWork: ...
    def close(self) -> None: ...
    def hold(self, stream: str, ms: typing.SupportsInt | typing.SupportsIndex) -> None:
        """
        For `ms` milliseconds, calls on `stream` ('comm', or 'caller': the current one) queue instead of running, as on a busy GPU; then they run.
        """
    def end_capture(self) -> HostGraph: ...
    def irecv(
        self,
        buf: typing_extensions.Buffer,
        peer: typing.SupportsInt | typing.SupportsIndex,
        tag: typing.SupportsInt | typing.SupportsIndex = 0,
        dtype: typing.Any = None,
    ) -> HostReceive:
        """
        Posts a receive and returns at once: a HostReceive whose wait() delivers it.
        """
    def reduce_scatter(
        self,
        input: typing_extensions.Buffer,
        output: typing_extensions.Buffer,
        op: str = "sum",
        dtype: typing.Any = None,
        async_op: bool | None = None,
    ) -> str | HostWork: ...
    def recv(
        self,
        buf: typing_extensions.Buffer,
        peer: typing.SupportsInt | typing.SupportsIndex,
        tag: typing.SupportsInt | typing.SupportsIndex = 0,
        dtype: typing.Any = None,
    ) -> str: ...
    def route(self, op: str, nbytes: typing.SupportsInt | typing.SupportsIndex) -> str:
        """
        'one-shot', 'two-shot', 'ipc' or 'staged' for `op` moving `nbytes` per rank.
        """
    def send(
        self,
        buf: typing_extensions.Buffer,
        peer: typing.SupportsInt | typing.SupportsIndex,
        tag: typing.SupportsInt | typing.SupportsIndex = 0,
        dtype: typing.Any = None,
    ) -> str: ...
    @property
    def device_bytes(self) -> int:
        """
        The bytes of this rank's IPC buffer (0 before setup, or staged).
        """
    @property
    def devices(self) -> list[int]:
        """
        Each rank's device index, as the IPC setup exchanged them.
        """
    @property
    def status(self) -> str: ...
    @property
    def stream(self) -> int:
        """
        The caller's current stream: 0 (the null stream: calls run at once, the default) or a host stream 1 to 4.
        """
    @stream.setter
    def stream(self, arg1: typing.SupportsInt | typing.SupportsIndex) -> None: ...

def _all_reduce_cost(
    algo: str,
    nbytes: typing.SupportsFloat | typing.SupportsIndex,
    host_of: list[int],
    model: dict,
) -> float:
    """
    The engine's predicted seconds for an all-reduce of nbytes on ranks placed on host_of[r] (model: a dict of shm_alpha, shm_beta, net_alpha, net_beta, gamma).
    """

def _choose_all_reduce(
    nbytes: typing.SupportsFloat | typing.SupportsIndex,
    host_of: list[int],
    model: dict,
) -> str:
    """
    What CLAWCOMM_ALGO=auto picks for an all-reduce of nbytes on that layout.
    """

def _algorithm_table() -> list[tuple[str, str]]:
    """
    Every (op, algorithm) CLAWCOMM_ALGO can name, in the table's order.
    """

def _choose_algorithm(
    op: str,
    nbytes: typing.SupportsFloat | typing.SupportsIndex,
    host_of: list[int],
    model: dict,
    algo: str = "auto",
    transport: str = "auto",
) -> str:
    """
    The algorithm `op` (all_reduce, reduce_scatter, all_gather, broadcast, reduce) of nbytes runs on that layout under CLAWCOMM_ALGO=algo and CLAWCOMM_TRANSPORT=transport.
    """

def _collective_cost(
    op: str,
    algo: str,
    nbytes: typing.SupportsFloat | typing.SupportsIndex,
    host_of: list[int],
    model: dict,
) -> float:
    """
    The cost model's seconds for `op` by `algo` (inf where the layout cannot run it).
    """

def _drop_last_reference_in_callback(small: bool = False) -> str:
    """
    Test hook: a one-rank communicator's last reference dropped inside its completion callback (small: an op run inline on the caller's thread); returns the thread the callback ran on.
    """

def _engine_from_handle(handle: typing_extensions.CapsuleType) -> Engine:
    """
    The Engine behind a handle from ClawcommBackend._engine_handle().
    """

def _peer_dies_just_after_its_last_write() -> bool:
    """
    Test hook: whether a shared-memory peer that writes its last frame and exits just as this rank looks at its process is taken for dead with nothing written (it must not be).
    """

def _feed_frames(data: str, recv_bytes: typing.SupportsInt | typing.SupportsIndex = -1) -> str:
    """
    Test hook: parses `data` as the frames rank 1 sends rank 0, then receives a point-to-point message of recv_bytes (tag 0) if recv_bytes >= 0. Returns the error raised, or ''.
    """

def _check_settings() -> None:
    """
    Reads every CLAWCOMM_* setting as a communicator would; raises ValueError naming the first bad one (a launcher checks them once, before it starts any rank).
    """

def _shutdown_all() -> None:
    """
    Shuts down every live communicator (registered with atexit by clawcomm).
    """

cuda_built: bool  # True in CUDA builds, which add the `cuda` submodule
