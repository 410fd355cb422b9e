"""Neuron device memory (Trainium), pushed with NIXL's LIBFABRIC backend over EFA (Neuron Direct RDMA).

NIXL registers Neuron HBM as VRAM; its LIBFABRIC plugin marks it FI_HMEM_NEURON and picks the EFA rail
attached to the device (`nrt_get_attached_efa_bdf`). That works only when every prerequisite holds, and
several fail *silently* (device memory registered as host memory), so they are checked here with named
errors (facts and sources: ../shared/notes/neuron.md):

* NEURON_RT_MAP_HBM=1 set before the Neuron runtime initialises: without it device tensors have no
  address (`data_ptr() == 0`) to register;
* the runtime initialised before the NIXL agent is created (libfabric's HMEM init must see it, otherwise
  Neuron memory silently registers as FI_HMEM_SYSTEM);
* a runtime that exports `nrt_get_attached_efa_bdf` (Neuron Runtime >= 2.31.24, SDK 2.29);
* LIBFABRIC loaded and listing VRAM (kvpush.transport.nixl.check_backend);
* FI_EFA_ENABLE_SHM_TRANSFER=0 when prefill and decode share a host (libfabric's shm provider cannot copy
  Neuron memory: wrong output, no error).

vllm-neuron hands over one tensor per attention layer, (2, B, H, N, D): the layout probe makes one region
per layer tensor with a K and a V plane; `NeuronKVCache.wrap` describes them, `NeuronKVCache.allocate`
allocates the same shape through the runtime. The runtime is reached through
ctypes (`NeuronRuntime`); tests load a stand-in library written in this project instead of libnrt.

Not run here: no Trainium, no EFA. The stand-in exercises the probing, the checks and the staging copies.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np

from kvpush.config import KVPushConfig
from kvpush.errors import ConfigError, LayoutError
from kvpush.protocol.layout import KVLayout, Region, packed_planes

from .base import Barrier, Bytes

EFA_BDF_SYMBOL = "nrt_get_attached_efa_bdf"
EFA_BDF_MIN_RUNTIME = (2, 31, 24)  # first runtime exporting it (SDK 2.29.0)
NRT_UNINITIALIZED = 13  # nrt_status.h: an API called before nrt_init()
NRT_CLOSED = 14  # nrt_status.h: an API called after nrt_close()
NRT_TENSOR_PLACEMENT_HOST = 1  # nrt.h nrt_tensor_placement_t
LIBNRT_ENV = "KVPUSH_LIBNRT"  # an explicit libnrt path (tests point it at the stand-in)
_LIBNRT_NAME = re.compile(r"libnrt\.so(\.\d+)*")
LIBNRT_CANDIDATES = ("/opt/aws/neuron/lib/libnrt.so.1", "libnrt.so.1")
MAP_HBM_HELP = (
    "set NEURON_RT_MAP_HBM=1 in the environment before the Neuron runtime initialises (before the first "
    "Neuron tensor or torch-neuronx runtime call): without it Neuron device memory has no address that "
    "NIXL can register"
)


class NeuronPrerequisiteError(ConfigError):
    """A Neuron, libfabric or environment prerequisite of device-direct transfer does not hold."""


def mapped_libnrt(maps: str | None = None) -> str | None:
    """The path of a libnrt.so[.N] mapped into this process (from /proc/self/maps), if any."""
    if maps is None:
        try:
            with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
                maps = f.read()
        except OSError:
            return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
        path = fields[5].strip() if len(fields) == 6 else ""
        if _LIBNRT_NAME.fullmatch(os.path.basename(path)):
            return path
    return None


class _Version(ctypes.Structure):
    _fields_ = [
        ("rt_major", ctypes.c_uint64),
        ("rt_minor", ctypes.c_uint64),
        ("rt_patch", ctypes.c_uint64),
        ("rt_maintenance", ctypes.c_uint64),
        ("rt_detail", ctypes.c_char * 128),
        ("git_hash", ctypes.c_char * 64),
    ]


class NeuronRuntime:
    """The parts of libnrt kvpush uses, through ctypes (signatures as in the SDK's nrt.h)."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.lib = lib
        self.path = path
        if self.has_symbol("nrt_tensor_get_va"):
            lib.nrt_tensor_get_va.restype = ctypes.c_void_p
            lib.nrt_tensor_get_va.argtypes = [ctypes.c_void_p]
        for name in ("nrt_tensor_read", "nrt_tensor_write"):
            if self.has_symbol(name):
                fn = getattr(lib, name)
                fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]

    @classmethod
    def load(cls, path: str | None = None) -> NeuronRuntime:
        """libnrt from `path`, else $KVPUSH_LIBNRT, else the libnrt already mapped into this process (the
        instance vLLM Neuron's torch initialised: a second copy from another path would answer "not
        initialised"), else /opt/aws/neuron/lib, else the loader path; NeuronPrerequisiteError when none
        loads."""
        errors = []
        path = path or os.environ.get(LIBNRT_ENV) or mapped_libnrt() or None
        for cand in (path,) if path else LIBNRT_CANDIDATES:
            try:
                return cls(ctypes.CDLL(cand), cand)
            except OSError as exc:
                errors.append(f"{cand}: {exc}")
        raise NeuronPrerequisiteError("the Neuron runtime library is not loadable: " + "; ".join(errors))

    def has_symbol(self, name: str) -> bool:
        return hasattr(self.lib, name)

    def version(self) -> tuple[int, int, int, int]:
        v = _Version()
        if self.lib.nrt_get_version(ctypes.byref(v), ctypes.sizeof(v)) != 0:
            raise NeuronPrerequisiteError(f"nrt_get_version failed in {self.path}")
        return int(v.rt_major), int(v.rt_minor), int(v.rt_patch), int(v.rt_maintenance)

    def initialised(self) -> bool:
        """Whether the runtime is between nrt_init() and nrt_close().

        nrt_status.h documents NRT_UNINITIALIZED (13) and NRT_CLOSED (14) as the "unique retcodes to help
        the caller identify when nrt apis are called outside the scope of nrt_init() and nrt_close()";
        the count getters (nrt_get_visible_nc_count and friends) are documented in nrt.h as callable
        before nrt_init(), so they answer either way and cannot tell. Asked instead: a pure query that
        is not marked so, nrt_get_vnc_memory_stats(vnc 0) (vLLM Neuron's workers see their one core as
        0); on a runtime without it, allocating and freeing a one-byte host tensor (nrt_tensor_allocate,
        placement HOST, vnc -1). Any status but 13 / 14 means the call ran inside init's scope.
        """
        if self.has_symbol("nrt_get_vnc_memory_stats"):
            stats = (ctypes.c_size_t * 2)()
            written = ctypes.c_size_t(0)
            rc = int(
                self.lib.nrt_get_vnc_memory_stats(
                    ctypes.c_uint32(0), ctypes.byref(stats), ctypes.sizeof(stats), ctypes.byref(written)
                )
            )
        else:
            handle = ctypes.c_void_p()
            rc = int(
                self.lib.nrt_tensor_allocate(
                    NRT_TENSOR_PLACEMENT_HOST,
                    -1,
                    ctypes.c_size_t(1),
                    b"kvpush-init-probe",
                    ctypes.byref(handle),
                )
            )
            if rc == 0 and handle.value:
                self.lib.nrt_tensor_free(ctypes.byref(handle))
        return rc not in (NRT_UNINITIALIZED, NRT_CLOSED)

    def attached_efa_bdf(self, va: int) -> str | None:
        """The PCI address of the EFA attached to the device owning `va` (None when the query fails)."""
        if not self.has_symbol(EFA_BDF_SYMBOL):
            return None
        buf = ctypes.create_string_buffer(32)
        n = ctypes.c_size_t(len(buf))
        rc = self.lib.nrt_get_attached_efa_bdf(ctypes.c_void_p(va), buf, ctypes.byref(n))
        return buf.value.decode() if rc == 0 else None

    # device tensors (used by the stand-in tests and by staging through the runtime)
    def tensor_allocate(self, nbytes: int, logical_nc: int = 0, name: str = "kvpush") -> int:
        handle = ctypes.c_void_p()
        rc = self.lib.nrt_tensor_allocate(
            0, logical_nc, ctypes.c_size_t(nbytes), name.encode(), ctypes.byref(handle)
        )
        if rc != 0 or not handle.value:
            raise NeuronPrerequisiteError(f"nrt_tensor_allocate of {nbytes} bytes failed (status {rc})")
        return int(handle.value)

    def tensor_va(self, handle: int) -> int:
        return int(self.lib.nrt_tensor_get_va(ctypes.c_void_p(handle)) or 0)

    def tensor_read(self, handle: int, offset: int, out: Bytes) -> None:
        rc = self.lib.nrt_tensor_read(ctypes.c_void_p(handle), int(out.ctypes.data), offset, out.nbytes)
        if rc != 0:
            raise LayoutError(f"nrt_tensor_read of {out.nbytes} bytes at {offset} failed (status {rc})")

    def tensor_write(self, handle: int, offset: int, src: Bytes) -> None:
        rc = self.lib.nrt_tensor_write(ctypes.c_void_p(handle), int(src.ctypes.data), offset, src.nbytes)
        if rc != 0:
            raise LayoutError(f"nrt_tensor_write of {src.nbytes} bytes at {offset} failed (status {rc})")

    def tensor_free(self, handle: int) -> None:
        h = ctypes.c_void_p(handle)
        self.lib.nrt_tensor_free(ctypes.byref(h))


def neuron_environment(single_host: bool) -> dict[str, str]:
    """What the Neuron runtime and libfabric must see, set before either starts."""
    env = {"NEURON_RT_MAP_HBM": "1", "FI_PROVIDER": "efa"}
    if single_host:
        env["FI_EFA_ENABLE_SHM_TRANSFER"] = "0"
    return env


def apply_neuron_environment(
    single_host: bool, environ: MutableMapping[str, str] | None = None, runtime: NeuronRuntime | None = None
) -> dict[str, str]:
    """Set the Neuron environment (returns what was set); refuse a conflicting value, and refuse when the
    runtime is already up without NEURON_RT_MAP_HBM=1 (it reads the variable only when it starts)."""
    env = os.environ if environ is None else environ
    if runtime is not None and runtime.initialised() and env.get("NEURON_RT_MAP_HBM") != "1":
        raise NeuronPrerequisiteError(
            f"the Neuron runtime is already initialised without HBM mapping; {MAP_HBM_HELP}"
        )
    changed = {}
    for key, value in neuron_environment(single_host).items():
        have = env.get(key)
        if have is None:
            env[key] = value
            changed[key] = value
        elif have != value:
            raise NeuronPrerequisiteError(
                f"{key}={have} but Neuron device-direct transfer needs {key}={value}"
            )
    return changed


def check_neuron_prerequisites(
    runtime: NeuronRuntime,
    *,
    single_host: bool,
    regions: Sequence[Region] = (),
    agent: Any = None,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Raise NeuronPrerequisiteError (or TransportError for the NIXL checks) naming the first broken one.

    Call after the runtime is initialised and the KV tensors exist, before the NIXL agent is created
    (`agent=None`), and again with the agent to check LIBFABRIC and VRAM.
    """
    env = os.environ if environ is None else environ
    if env.get("NEURON_RT_MAP_HBM") != "1":
        raise NeuronPrerequisiteError(
            f"NEURON_RT_MAP_HBM is {env.get('NEURON_RT_MAP_HBM')!r}; {MAP_HBM_HELP}"
        )
    if not runtime.initialised():
        raise NeuronPrerequisiteError(
            "the Neuron runtime is not initialised: initialise it (vllm-neuron: the worker's "
            "torch.classes.neuron.Runtime().initialize()) before creating the NIXL agent, otherwise NIXL's "
            "LIBFABRIC silently registers Neuron memory as host memory (FI_HMEM_SYSTEM)"
        )
    if not runtime.has_symbol(EFA_BDF_SYMBOL):
        have = ".".join(map(str, runtime.version()))
        need = ".".join(map(str, EFA_BDF_MIN_RUNTIME))
        raise NeuronPrerequisiteError(
            f"Neuron runtime {have} ({runtime.path}) lacks {EFA_BDF_SYMBOL}: NIXL then cannot pick the EFA "
            f"attached to each device; device-direct needs runtime >= {need} (Neuron SDK >= 2.29)"
        )
    if single_host and env.get("FI_EFA_ENABLE_SHM_TRANSFER") != "0":
        raise NeuronPrerequisiteError(
            "prefill and decode share this host: set FI_EFA_ENABLE_SHM_TRANSFER=0 (libfabric's shm provider "
            "cannot copy Neuron memory and requests produce wrong output)"
        )
    for r in regions:
        if r.addr == 0:
            raise NeuronPrerequisiteError(
                f"a KV cache region of {r.nbytes} bytes has address 0; {MAP_HBM_HELP}"
            )
    if agent is not None:
        from kvpush.transport.nixl import check_backend

        check_backend(agent, "LIBFABRIC", ["VRAM"])


def check_neuron_connector(
    regions: Sequence[Region],
    *,
    single_host: bool,
    runtime: NeuronRuntime | None = None,
    environ: Mapping[str, str] | None = None,
) -> None:
    """The prerequisites a vLLM worker checks when the connector starts on Neuron device memory, refusing
    by name what `kvpush doctor` would report: HBM mapping (NEURON_RT_MAP_HBM=1), an initialised runtime
    exporting the EFA lookup, and, when prefill and decode share this host, FI_EFA_ENABLE_SHM_TRANSFER=0
    (libfabric's shm provider cannot copy Neuron memory: wrong output, no error).

    Runs before the NIXL agent exists (the endpoint creates it next); LIBFABRIC and VRAM are checked when
    the agent is created (kvpush.transport.nixl.check_backend). `runtime` defaults to NeuronRuntime.load().
    """
    env = os.environ if environ is None else environ
    if env.get("NEURON_RT_MAP_HBM") != "1":  # first: it needs no runtime to say
        raise NeuronPrerequisiteError(
            f"NEURON_RT_MAP_HBM is {env.get('NEURON_RT_MAP_HBM')!r} in the vLLM worker; {MAP_HBM_HELP}"
        )
    if single_host and env.get("FI_EFA_ENABLE_SHM_TRANSFER") != "0":
        raise NeuronPrerequisiteError(
            "prefill and decode share this host: set FI_EFA_ENABLE_SHM_TRANSFER=0 in both engines' "
            "environment (libfabric's shm provider cannot copy Neuron memory and requests produce wrong "
            f"output); it is {env.get('FI_EFA_ENABLE_SHM_TRANSFER')!r}"
        )
    check_neuron_prerequisites(
        runtime if runtime is not None else NeuronRuntime.load(),
        single_host=single_host,
        regions=regions,
        environ=env,
    )


def neuron_kv_written_barrier(reads: Sequence[Callable[[], object]]) -> Barrier:
    """The "KV of this step is in HBM" barrier: read a few bytes of every KV region back to the host.

    Why a read-back: vLLM Neuron runs a step as a NEFF submitted to the Neuron runtime's in-order
    execution queue, with the KV cache aliased in and out of the compiled graph, and learns that a
    step's outputs are complete by reading an output back: `AsyncNeuronModelRunnerOutput.get_output()`
    in vllm_neuron/vllm/worker/neuron_model_runner.py (vllm-project/vllm-neuron @9fc042ea) calls
    `sampled_token_ids.cpu()`, "a blocking call that waits until the results are ready", and reads
    even discarded chunk outputs back "to drain the segment NEFF from the NRT execution queue". The
    runtime tracks tensors that pending executions write and blocks reads of them (nrt.h's batch
    read/write take an `unsafe` flag to "skip tensor tracking/blocking"), so a read of a KV tensor
    issued after the step was submitted returns once the NEFF that writes it has finished.

    Built on the engine thread at hand-off (no wait: the closures are only collected) and called on
    the push thread before the WRITE is posted. Unverified on hardware (docs/backends.md): that
    libtorch_neuronx_lite's device->host copy of an aliased KV tensor goes through the tracked read.
    """
    pending = tuple(reads)
    if not pending:
        raise NeuronPrerequisiteError("a Neuron KV-written barrier needs at least one KV region to read back")

    def wait() -> None:
        for read in pending:
            read()

    return wait


class NeuronKVCache:
    """A rank's KV cache in Neuron device memory, owned by the engine or allocated through the runtime.

    `layout` is placed in device memory (one region per layer tensor, K and V planes inside);
    `read`/`write` copy a region's bytes to/from host (torch copies for engine tensors, nrt_tensor_read /
    write for runtime tensors). Region addresses of 0 are refused with the MAP_HBM explanation.
    """

    mem_type = "VRAM"
    device_type = "neuron"

    def __init__(
        self,
        layout: KVLayout,
        read: Callable[[int, int, Bytes], None],
        write: Callable[[int, int, Bytes], None],
        barrier: Callable[[], Barrier | None] | None = None,
        keepalive: object = None,
    ) -> None:
        if not layout.regions:
            raise LayoutError("NeuronKVCache needs a layout placed in device memory")
        for r in layout.regions:
            if r.addr == 0:
                raise NeuronPrerequisiteError(
                    f"a Neuron KV region of {r.nbytes} bytes has address 0; {MAP_HBM_HELP}"
                )
        self.layout = layout
        self._read, self._write = read, write
        self._barrier = barrier if barrier is not None else self._readback_barrier
        self._keepalive = keepalive

    @property
    def device_id(self) -> int:
        return self.layout.regions[0].device_id

    @property
    def regions(self) -> tuple[Region, ...]:
        return self.layout.regions

    def kv_written_barrier(self) -> Barrier | None:
        return self._barrier()

    def _readback_barrier(self) -> Barrier:
        """One byte of every region read back through this cache's own device -> host copy."""
        probe = np.empty(1, dtype=np.uint8)
        return neuron_kv_written_barrier(
            [functools.partial(self._read, i, 0, probe) for i in range(len(self.layout.regions))]
        )

    def read_into(self, region: int, offset: int, out: Bytes) -> None:
        self._read(region, offset, out)

    def write_from(self, region: int, offset: int, src: Bytes) -> None:
        self._write(region, offset, src)

    @classmethod
    def allocate(
        cls,
        geometry: KVLayout,
        runtime: NeuronRuntime,
        logical_nc: int = 0,
        barrier: Callable[[], Barrier | None] | None = None,
    ) -> NeuronKVCache:
        """One runtime tensor per layer holding its K and V planes, as vllm-neuron lays them out."""
        per_layer = packed_planes(KVLayout(**{**_geometry_kwargs(geometry), "num_layers": 1}), 0x1000)
        layer_bytes = per_layer.regions[0].nbytes
        handles = [
            runtime.tensor_allocate(layer_bytes, logical_nc, f"kv{i}") for i in range(geometry.num_layers)
        ]
        vas = [runtime.tensor_va(h) for h in handles]
        if any(va == 0 for va in vas):
            for h in handles:
                runtime.tensor_free(h)
            raise NeuronPrerequisiteError(
                f"Neuron runtime tensors have no virtual address (0); {MAP_HBM_HELP}"
            )
        regions = tuple(Region(va, layer_bytes, logical_nc) for va in vas)
        planes = tuple(
            type(p)(layer, p.kv, layer, p.offset)
            for layer in range(geometry.num_layers)
            for p in per_layer.planes
        )
        layout = geometry.with_memory(regions, planes)

        def read(region: int, offset: int, out: Bytes) -> None:
            runtime.tensor_read(handles[region], offset, out)

        def write(region: int, offset: int, src: Bytes) -> None:
            runtime.tensor_write(handles[region], offset, src)

        cache = cls(layout, read, write, barrier=barrier, keepalive=handles)
        cache.handles = handles
        cache.runtime = runtime
        return cache

    @classmethod
    def wrap(cls, layout: KVLayout, tensors: list[Any]) -> NeuronKVCache:
        """vllm-neuron's KV tensors (one per region, in region order, as the layout probe placed them).

        Host copies go through torch on flat uint8 views of the tensors' storages; a host -> device copy
        is followed by a read-back of the same bytes (the barrier's mechanism) so it is complete before
        the request is reported ready. Unverified on hardware.
        """
        import torch

        if len(tensors) != len(layout.regions):
            raise LayoutError(f"{len(tensors)} tensors for {len(layout.regions)} regions")
        flat = [torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()) for t in tensors]

        def read(region: int, offset: int, out: Bytes) -> None:
            torch.from_numpy(out).copy_(flat[region][offset : offset + out.nbytes].cpu())

        def write(region: int, offset: int, src: Bytes) -> None:
            flat[region][offset : offset + src.nbytes].copy_(torch.from_numpy(src))
            flat[region][offset : offset + 1].cpu()

        return cls(layout, read, write, keepalive=tensors)

    handles: list[int]
    runtime: NeuronRuntime

    def free(self) -> None:
        """Free runtime-allocated tensors (engine-owned tensors are the engine's)."""
        for h in getattr(self, "handles", []):
            self.runtime.tensor_free(h)
        self.handles = []


def _geometry_kwargs(layout: KVLayout) -> dict[str, Any]:
    return {
        "num_layers": layout.num_layers,
        "block_size": layout.block_size,
        "num_blocks": layout.num_blocks,
        "total_kv_heads": layout.total_kv_heads,
        "head_dim": layout.head_dim,
        "dtype_size": layout.dtype_size,
        "tp_rank": layout.tp_rank,
        "tp_size": layout.tp_size,
        "kv_per_layer": layout.kv_per_layer,
        "token_order": layout.token_order,
        "block_stride": layout.block_stride,
        "model_tag": layout.model_tag,
        "atomic_blocks": layout.atomic_blocks,
    }


def neuron_config(engine_id: str, host: str, port: int = 5600, **overrides: object) -> KVPushConfig:
    """LIBFABRIC over EFA; UCX's loopback restriction does not apply."""
    base = dict(engine_id=engine_id, host=host, port=port, backends=("LIBFABRIC",), ucx_net_devices=None)
    base.update(overrides)
    return KVPushConfig.from_mapping(base)
