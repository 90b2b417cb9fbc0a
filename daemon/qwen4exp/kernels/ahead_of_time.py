"""Compiling the kernels for a GPU that is not here: the launches code would make, recorded, then built by Triton.

`recording()` puts a recorder in place of Triton's launcher: model code run on the meta device (under
guard.compiling_for) then launches nothing and allocates nothing, and each launch it would have made is kept
as a `Launch` (the kernel, its argument types and specialization, its constexprs and launch options, and the op
it ran in). `build(launch, target)` compiles one for a target the way Triton's launcher would on that GPU and
checks the limit Triton leaves to the first launch: the shared memory (LDS) a block asks for.

The specialization follows Triton's launcher: a pointer 16-byte aligned and an integer that is a multiple of 16
are marked divisible by 16 (the others listed with no attribute), an integer equal to 1 becomes a constant, None
a constexpr; bools and floats are not specialized. On the GPU, each launch compiled here has the cache key of
the binary the launcher built (tests/test_kernel_builds.py), so compiling on the GPU itself fills Triton's cache
for the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable

import torch

from .guard import Target, triton

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
          torch.bool: "u1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
_DIVISIBLE = [["tt.divisibility", 16]]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch as the compiler sees it (the grid and the data do not matter to it)."""
    kernel: object                       # the triton.JITFunction
    signature: dict[str, str]            # parameter -> "*bf16", "i32", "constexpr", ...
    constexprs: dict[tuple[int], object]  # (parameter index,) -> value
    attrs: dict[tuple[int], list]         # (parameter index,) -> [["tt.divisibility", 16]] or [] (pointers, ints)
    options: dict[str, int]              # launch options as given (num_warps, num_stages, ...)
    op: str                              # what launched it (the recorder's label)
    launched_hash: str | None = None     # the binary Triton's launcher ran, where it was launched for real

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def key(self) -> tuple:
        """Launches with one key compile to one binary."""
        return (self.kernel, repr(self.signature), repr(sorted(self.constexprs.items())),
                repr(sorted(self.attrs.items())), repr(sorted(self.options.items())))

    def describe(self) -> str:
        consts = ", ".join(f"{name}={self.constexprs[(i,)]}" for i, name in enumerate(self.signature)
                           if (i,) in self.constexprs)
        return f"{self.name}[{self.op}]({consts}; {', '.join(f'{k}={v}' for k, v in self.options.items())})"


@dataclasses.dataclass(frozen=True)
class Build:
    """A launch compiled for a target: `error` is None when it built and its shared memory fits."""
    launch: Launch
    target: Target
    shared: int | None
    error: str | None
    hash: str | None = None               # the binary's cache key: the launcher's, when the specialization matches


def specialize(kernel, args: tuple, kwargs: dict, op: str) -> Launch:
    """The Launch of `kernel[grid](*args, **kwargs)`."""
    options = {name: value for name, value in kwargs.items() if name not in kernel.signature.parameters}
    bound = kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k not in options})
    bound.apply_defaults()
    signature, constexprs, attrs = {}, {}, {}
    for index, (param, (name, value)) in enumerate(zip(kernel.params, bound.arguments.items())):
        # An int named in the kernel's do_not_specialize is neither made a constant at 1 nor given attributes.
        if param.is_constexpr or value is None or (type(value) is int and value == 1 and not param.do_not_specialize):
            signature[name] = "constexpr"
            constexprs[(index,)] = value
            if isinstance(value, str):
                attrs[(index,)] = []     # the launcher lists a string's specialization as an (empty) attribute
            continue
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            attrs[(index,)] = _DIVISIBLE if value.data_ptr() % 16 == 0 else []
        elif isinstance(value, bool):
            signature[name] = "u1"           # neither bools nor floats are specialized
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if not param.do_not_specialize:  # an unspecialized int has no attribute entry at all
                attrs[(index,)] = _DIVISIBLE if value % 16 == 0 else []
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: no Triton type for {name}={value!r}")
    return Launch(kernel, signature, constexprs, attrs, options, op)


@contextlib.contextmanager
def recording(label: Callable[[], str] = lambda: "", launch: bool = False):
    """Within this, Triton kernel launches are recorded (and not made, unless `launch`: then each also keeps
    the hash of the binary that ran); yields the list of Launches, each named by `label()` at its launch."""
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    run = JITFunction.run

    def record(kernel, *args, grid, warmup, **kwargs):
        made = specialize(kernel, args, kwargs, label())
        if launch:
            made = dataclasses.replace(made, launched_hash=run(kernel, *args, grid=grid, warmup=warmup, **kwargs).hash)
        launches.append(made)

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = run


def distinct(launches: Iterable[Launch]) -> list[Launch]:
    """One launch per binary, in first-seen order."""
    seen: dict[tuple, Launch] = {}
    for launch in launches:
        seen.setdefault(launch.key(), launch)
    return list(seen.values())


def build(launch: Launch, target: Target) -> Build:
    """Compile `launch` for `target` (no GPU needed) and check the shared memory it asks for."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(launch.kernel, launch.signature, launch.constexprs, launch.attrs)
    try:
        compiled = triton.compile(source, target=GPUTarget(target.backend, target.arch, target.warp_size),
                                  options=dict(launch.options))
    except Exception as error:  # noqa: BLE001 - the compiler's own message is the reason to report
        lines = [line for line in str(error).splitlines() if line.strip()]
        return Build(launch, target, None, f"{type(error).__name__}: {lines[0] if lines else 'no message'}")
    shared = int(compiled.metadata.shared)
    error = None
    if target.shared_memory is not None and shared > target.shared_memory:
        error = f"asks for {shared} bytes of shared memory; {target.name} gives a block {target.shared_memory}"
    return Build(launch, target, shared, error, compiled.hash)
