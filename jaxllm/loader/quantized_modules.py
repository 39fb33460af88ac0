"""Gather a quantized checkpoint's tensors module by module, convert each module when it is complete.

A quantized linear module is several tensors (`...q_proj.qweight`, `.qzeros`, `.scales`), possibly in
different files of a sharded checkpoint. `QuantizedModules.claim(name)` takes the tensors of the
decoder's linear modules (the name mapper says which modules those are: their `.weight` maps to a
`layers_N/.../kernel`), holds them until the module has every tensor its packing needs
(jaxllm/quantization/checkpoint_formats.py), then hands the canonical leaves to the ParamsBuilder
under the module's path. Host memory holds at most the modules still incomplete.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from jaxllm.loader.params_builder import ParamsBuilder
from jaxllm.quantization.checkpoint_formats import Packing

_DECODER_KERNEL = re.compile(r"^layers_\d+/.+/kernel$")


class QuantizedModules:
    def __init__(self, packing: Packing, builder: ParamsBuilder, mapper: Callable[[str], Any], source: str):
        self.packing = packing
        self.builder = builder
        self.mapper = mapper  # checkpoint name -> (path, transpose) | None (jaxllm/loader/names.py)
        self.source = source
        self.needed, self.skipped = packing.suffixes()
        self._pending: dict[str, tuple[str, dict[str, Any]]] = {}  # module name -> (kernel path, tensors)

    def claim(self, name: str, read: Callable[[], Any]) -> bool:
        """True when `name` belongs to a quantized module (then read and held, or skipped); False for
        tensors the float path loads (norms, embeddings, biases, an unquantized lm_head)."""
        module, _, suffix = name.rpartition(".")
        if suffix not in self.needed and suffix not in self.skipped:
            if suffix == "weight" or suffix == "bias":
                return False
            self._check_unknown(module, suffix, name)
            return False
        kernel_path = self._kernel_path(module)
        if kernel_path is None:
            if suffix == "weight":
                return False
            raise ValueError(
                f"{self.source}: tensor {name!r} is quantized, but {module!r} is not a decoder projection"
            )
        if suffix in self.skipped:
            return True
        _, tensors = self._pending.setdefault(module, (kernel_path, {}))
        tensors[suffix] = read()
        if self.needed <= tensors.keys():
            del self._pending[module]
            leaves = self.packing.convert(tensors, f"{self.source}: {module}")
            base = kernel_path.removesuffix("kernel")
            for leaf, value in leaves.items():
                self.builder.put(base + leaf, value, tensor_name=f"{module}.{leaf}")
        return True

    def finish(self) -> None:
        if self._pending:
            module, (_, tensors) = next(iter(self._pending.items()))
            lacks = sorted(self.needed - tensors.keys())
            raise ValueError(
                f"{self.source}: quantized module {module!r} ({self.packing.name}) lacks "
                f"{', '.join(f'{module}.{s}' for s in lacks)}"
                + (
                    f" (and {len(self._pending) - 1} more modules are incomplete)"
                    if len(self._pending) > 1
                    else ""
                )
            )

    def _kernel_path(self, module: str) -> str | None:
        try:
            mapped = self.mapper(module + ".weight")
        except ValueError:
            return None
        if mapped is None or not _DECODER_KERNEL.match(mapped[0]):
            return None
        return mapped[0]

    def _check_unknown(self, module: str, suffix: str, name: str) -> None:
        if self._kernel_path(module) is not None:
            raise ValueError(
                f"{self.source}: tensor {name!r} is not part of the {self.packing.name} packing "
                f"(a quantized module has {', '.join(sorted(self.needed))})"
            )
