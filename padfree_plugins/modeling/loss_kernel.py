"""Which kernel computes the tiled LM head and loss (``memory.loss_kernel``): Liger's fused linear cross-entropy
(liger-kernel's Triton kernel, CUDA) where it is installed and the call fits, else the torch tiles of
:class:`~padfree_plugins.modeling.tiling.TiledHeadLoss`. Both compute the same loss: the summed cross-entropy of the
labelled positions (-100 ignored, transformers' label smoothing) over ``num_items_in_batch`` or the number of labels.

liger-kernel is found without importing it (``padfree-plugins list`` and ``check`` stay light) and imported at the
first loss it computes. Under Triton's interpreter (``TRITON_INTERPRET=1``) its kernel also runs on CPU tensors
(slowly: for tests).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
from dataclasses import dataclass, field

import torch

from padfree_plugins.errors import ConfigError

logger = logging.getLogger("padfree_plugins")

#: How to install the Liger kernel, for the messages that ask for it.
LIGER_INSTALL = "pip install 'padfree-plugins[liger]' (liger-kernel and triton; CUDA only)"
#: The dtypes Liger's fused linear cross-entropy takes.
LIGER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: ``memory.loss_kernel`` values.
CHOICES = ("auto", "torch", "liger")


def liger_version() -> str | None:
    """The installed liger-kernel's version, or None where it (or triton) is not installed; imports neither."""
    if importlib.util.find_spec("liger_kernel") is None or importlib.util.find_spec("triton") is None:
        return None
    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def triton_interprets() -> bool:
    """Whether Triton runs its kernels in its interpreter (``TRITON_INTERPRET=1``: on CPU tensors too)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_loss_kernel(choice: str) -> None:
    """``memory.loss_kernel: liger`` without liger-kernel installed: a :class:`ConfigError` saying how to install it."""
    if choice == "liger" and liger_version() is None:
        raise ConfigError(f"memory.loss_kernel: liger, but liger-kernel (with triton) is not installed: {LIGER_INSTALL}"
                          ", or set memory.loss_kernel: auto (Liger where installed, else the torch tiles) or torch")


def planned(choice: str, device_type: str) -> str:
    """Which kernel the tiled loss will use on ``device_type``, in words (for ``check``)."""
    version = liger_version()
    if choice == "torch":
        return "torch tiles (memory.loss_kernel: torch)"
    if version is None:
        return "torch tiles (liger-kernel is not installed)"
    if device_type != "cuda" and not triton_interprets():
        return (f"torch tiles (liger-kernel {version} is installed; its kernel runs on CUDA, the device is "
                f"{device_type})")
    return (f"Liger fused linear cross-entropy (liger-kernel {version}) for the calls it fits (CUDA tensors of "
            "float32 / bfloat16 / float16), torch tiles for the others")


def why_not_liger(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[str, str] | None:
    """Why Liger's kernel cannot compute this call's loss as the torch tiles do: (kind, reason), or None (it fits)."""
    if hidden.device.type != "cuda" and not triton_interprets():
        return "device", f"the tensors are on {hidden.device.type} (Liger's Triton kernel runs on CUDA)"
    if hidden.dtype not in LIGER_DTYPES:
        return "dtype", f"the hidden states are {hidden.dtype} (Liger takes float32, bfloat16 and float16)"
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        return "mixed dtypes", (f"the hidden states are {hidden.dtype} and the LM head's weight {weight.dtype} "
                                "(Liger multiplies them as they are)")
    if hidden.shape[0] == 0:
        return "empty", "no position is labelled"
    if torch.is_grad_enabled() and weight.requires_grad and not hidden.requires_grad:
        return "frozen input", ("the LM head is trained while its input needs no gradient (Liger computes the head's "
                                "gradient only with its input's)")
    return None


def liger_head_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                    divisor: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Liger's fused linear cross-entropy of ``hidden [K, H] @ weight.T (+ bias)`` against ``labels [K]``: summed
    (-100 ignored; label smoothing as torch's), over ``divisor``; weight and bias gradients accumulated in float32."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    summed = liger_fused_linear_cross_entropy(hidden, weight, labels, bias=bias, ignore_index=-100,
                                              label_smoothing=smoothing, reduction="sum", accum_dtype=torch.float32)
    return summed / divisor


@dataclass
class LossKernel:
    """``memory.loss_kernel`` for one assembly: ``auto`` (Liger where installed and the call fits), ``torch``, or
    ``liger`` (asked for: a call it does not fit runs the torch tiles with a warning, once per kind of call)."""

    choice: str = "torch"
    #: liger-kernel's version, or None (not installed): read once, at assembly.
    version: str | None = None
    warned: set[str] = field(default_factory=set, compare=False, repr=False)

    @classmethod
    def of(cls, choice: str) -> "LossKernel":
        """The kernel for a config's ``memory.loss_kernel`` (``liger`` without liger-kernel: a :class:`ConfigError`)."""
        check_loss_kernel(choice)
        return cls(choice, None if choice == "torch" else liger_version())

    def uses_liger(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether Liger computes this call's loss; says once per kind of call why it does not (a warning where Liger
        was asked for, an info line under ``auto``)."""
        if self.choice == "torch" or self.version is None:
            return False
        why = why_not_liger(hidden, weight, bias)
        if why is None:
            return True
        kind, reason = why
        if kind not in self.warned:
            self.warned.add(kind)
            log = logger.warning if self.choice == "liger" else logger.info
            log("padfree-plugins: memory.loss_kernel: %s: Liger does not compute a loss where %s; such calls run "
                "the torch tiles (said once)", self.choice, reason)
        return False

    def loss(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
             divisor: torch.Tensor, smoothing: float) -> torch.Tensor:
        """The loss by Liger (call :meth:`uses_liger` first)."""
        return liger_head_loss(hidden, weight, bias, labels, divisor, smoothing)


__all__ = ("LossKernel", "LIGER_INSTALL", "liger_version", "check_loss_kernel", "planned", "why_not_liger",
           "liger_head_loss", "triton_interprets")
