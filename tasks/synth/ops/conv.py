"""Convolutions as nn modules: Conv1d on signal values, Conv2d, depthwise Conv2d and ConvTranspose2d on
image values.

Shape rules (kernel k, stride s, padding p, all drawn):
    conv1d            (N, C, L)    -> (N, C_out, window(L))            C_out a new size constant
    conv2d            (N, C, H, W) -> (N, C_out, window(H), window(W))
    depthwise_conv2d  (N, C, H, W) -> (N, C, window(H), window(W))    groups = C
    conv_transpose2d  (N, C, H, W) -> (N, C_out, up(H), up(W))
where window(n) = (n + 2p - k) // s + 1 and up(n) = (n - 1)s - 2p + k, PyTorch's formulas. The input
channels and every convolved axis must not have size 1, and the output length must be at least 1 in
every environment (the builder checks that), so a stride-2 conv chain stops where the alt shapes
would run out of pixels.
"""

from __future__ import annotations

from math import prod

from tasks.synth.builder import Builder
from tasks.synth.dims import ONE, upsampled, window
from tasks.synth.graph import Node, Value
from tasks.synth.ops.base import Op, choose, non_one

FAMILY = "conv"

# (kernel, stride, padding) of the transposed convolutions: exact 2x upsampling, or same-size.
TRANSPOSED = ((2, 2, 0), (4, 2, 1), (3, 2, 1), (3, 1, 1), (3, 1, 0))


class Conv(Op):
    family = FAMILY
    module_prefix = "conv"

    def __init__(self, name: str, spatial: int, kernels: tuple, depthwise: bool = False, transposed: bool = False):
        self.name = name
        self.spatial = spatial  # 1 (Conv1d) or 2
        self.layouts = ("signal",) if spatial == 1 else ("image",)
        self.kernels = kernels
        self.depthwise = depthwise
        self.transposed = transposed

    def build(self, b: Builder, x: Value) -> Value | None:
        if x.layout not in self.layouts or not non_one(*x.shape[1:]):
            return None
        rng = b.rng
        if self.transposed:
            k, s, p = choose(rng, TRANSPOSED)
            out_len = lambda n: upsampled(n, k, s, p)
        else:
            k, s = choose(rng, self.kernels), choose(rng, (1, 1, 2))
            p = choose(rng, (0, k // 2))
            out_len = lambda n: window(n, k, s, p)
        c_in = x.shape[1]
        c_out = c_in if self.depthwise else b.new_var("channels")
        shape = (x.shape[0], c_out) + tuple(out_len(n) for n in x.shape[2:])
        return b.add(
            self.name,
            [x],
            shape,
            x.layout,
            in_channels=c_in,
            out_channels=c_out,
            kernel=k,
            stride=s,
            padding=p,
            bias=rng.random() < 0.7,
        )

    def init(self, node: Node, module: str, dim) -> list[str]:
        cls = "nn.ConvTranspose2d" if self.transposed else f"nn.Conv{self.spatial}d"
        c_in, c_out = dim(node.attr("in_channels")), dim(node.attr("out_channels"))
        extra = f", groups={c_in}" if self.depthwise else ""
        extra += "" if node.attr("bias") else ", bias=False"
        return [
            (
                f"self.{module} = {cls}({c_in}, {c_out}, {node.attr('kernel')}, stride={node.attr('stride')}, "
                f"padding={node.attr('padding')}{extra})"
            )
        ]

    def params(self, node: Node) -> list[tuple]:  # kernel taps are plain ints
        c_in, c_out, k = node.attr("in_channels"), node.attr("out_channels"), node.attr("kernel")
        taps = (k,) * self.spatial
        if self.transposed:
            weight = (c_in, c_out) + taps
        else:
            weight = (c_out, ONE if self.depthwise else c_in) + taps
        return [weight, (c_out,)] if node.attr("bias") else [weight]

    def forward(self, node: Node, args: list[str], module: str, dim) -> str:
        return f"self.{module}({args[0]})"

    def flops(self, node: Node, shape) -> int:
        taps = node.attr("kernel") ** self.spatial
        if self.transposed:
            return 2 * prod(shape(node.inputs[0])) * shape(node.out)[1] * taps
        per_output = 1 if self.depthwise else shape(node.inputs[0])[1]
        return 2 * prod(shape(node.out)) * per_output * taps


OPS = [
    Conv("conv1d", 1, (1, 3, 5, 7)),
    Conv("conv2d", 2, (1, 3, 5)),
    Conv("depthwise_conv2d", 2, (3, 5), depthwise=True),
    Conv("conv_transpose2d", 2, (), transposed=True),
]
