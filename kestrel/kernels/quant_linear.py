"""QuantLinear: a drop-in nn.Linear whose weight lives in the internal packed layout.

On CUDA the forward runs the Triton WNA16 GEMM; on the CPU it runs the reference dequantize + matmul (the weight
is dequantized once and cached), unless `use_kernel=True` forces the Triton kernel (interpreter tests).
"""
from __future__ import annotations

import torch
from torch import nn

from kestrel.kernels.gemm_wna16 import gemm_wna16
from kestrel.quant.rtn import quantize
from kestrel.quant.spec import QuantSpec
from kestrel.quant.weight import QuantizedWeight, dequantize

_QW_TENSORS = ("qweight", "scales", "zeros", "perm", "global_scale")


class QuantLinear(nn.Module):
    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None = None, use_kernel: bool | None = None):
        super().__init__()
        if qweight.spec.act_dtype not in ("bf16", "fp16"):
            raise ValueError(f"QuantLinear runs WNA16 (bf16/fp16 activations); {qweight.spec.name} needs a W*A* kernel")
        self.spec = qweight.spec
        self.out_features, self.in_features = qweight.shape
        for name in _QW_TENSORS:  # buffers, so .to()/.cuda() and state_dict carry the packed weight
            self.register_buffer(name, getattr(qweight, name))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.use_kernel = use_kernel
        self._dense: torch.Tensor | None = None

    @classmethod
    def from_float(cls, linear_or_weight: nn.Linear | torch.Tensor, spec: QuantSpec, **kw) -> "QuantLinear":
        if isinstance(linear_or_weight, nn.Linear):
            w, b = linear_or_weight.weight, linear_or_weight.bias
        else:
            w, b = linear_or_weight, None
        return cls(quantize(w, spec), b, **kw)

    @property
    def qweight_struct(self) -> QuantizedWeight:
        return QuantizedWeight(spec=self.spec, shape=(self.out_features, self.in_features),
                               **{n: getattr(self, n) for n in _QW_TENSORS})

    def _apply(self, fn, recurse=True):
        self._dense = None  # device/dtype moves invalidate the CPU dequant cache
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use_kernel = self.use_kernel if self.use_kernel is not None else x.is_cuda
        if use_kernel:
            y = gemm_wna16(x, self.qweight_struct)
        else:
            if self._dense is None or self._dense.dtype != x.dtype:
                self._dense = dequantize(self.qweight_struct).to(device=x.device, dtype=x.dtype)
            y = x @ self._dense.t()
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, spec={self.spec.name}"
