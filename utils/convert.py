"""What ``from_torch`` checks and copies: PyTorch's modules into the book's (chapters 3 to 9).

Every ``from_torch`` of the library (`utils.attention.MultiHeadAttention`,
`utils.layers.LayerNorm` and `utils.layers.RMSNorm`, the layers and stacks of
`utils.transformer`) proves that what the reader built is the real thing: it copies the
parameters of the `torch.nn` counterpart into a new from-scratch module, so that both give the
same output on the same input. This module holds the two halves of that work:

* the checks, made before a single parameter is copied: the torch module is of the expected
  kind, everything it does can be reproduced exactly (no ``batch_first=False``, no missing bias,
  one eps, one dropout probability, relu or the exact gelu, ...), and its parameters share one
  floating-point dtype and one device;
* the copying: weights and biases of linear maps and norms, the fused (3 d_model, d_model) input
  projection of ``nn.MultiheadAttention`` split into W_Q, W_K and W_V (each (d_model, d_model)
  in ``nn.Linear``'s storage, the transpose of the book's row-vector W), and the copy moved to
  the torch module's dtype, device and train/eval mode.

Shapes are those of the modules copied: batch first, (B, L, d_model).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import InputTypeError

__all__ = [
    "require_module",
    "require_uniform_parameters",
    "torch_activation",
    "torch_attention",
    "torch_linear",
    "torch_norm",
    "all_equal",
    "like",
    "finish_copy",
    "copy_linear",
    "layer_config",
    "stack_config",
    "copy_multihead_attention",
    "match_bias",
    "norm_size",
    "copy_norm",
]


def require_module(name: str, module: object, cls: type[nn.Module]) -> None:
    if not isinstance(module, cls):
        raise InputTypeError(f"{name} must be an nn.{cls.__name__}, got {type(module).__name__}")


def require_uniform_parameters(name: str, module: nn.Module) -> None:
    """Every parameter floating point, with one dtype on one device (else the copy would round
    or move some of them)."""
    kinds = sorted({(str(p.dtype), str(p.device)) for p in module.parameters()})
    if len(kinds) > 1:
        raise InputTypeError(
            f"{name}'s parameters mix dtypes or devices ({', '.join(' on '.join(k) for k in kinds)}"
            f"); convert it with {name}.to(dtype, device) first"
        )
    if any(not p.is_floating_point() for p in module.parameters()):
        raise InputTypeError(f"{name}'s parameters must be floating point, got {kinds}")


def torch_activation(name: str, module: nn.Module) -> str:
    """'relu' or 'gelu' for a torch Transformer layer, or a ValueError for anything else."""
    act = getattr(module, "activation", F.relu)
    if act is F.relu or act is torch.relu or isinstance(act, nn.ReLU):
        found = "relu"
    elif act is F.gelu or (isinstance(act, nn.GELU) and act.approximate == "none"):
        found = "gelu"
    else:
        raise ValueError(
            f"{name}.activation must be relu or the exact gelu (approximate='none'), got {act!r}"
        )
    # The encoder layer's fast path (eval mode, no autograd) reads this flag, not .activation
    # (0 turns the fast path off): if someone swapped .activation after construction, torch's
    # two paths compute different functions.
    flag = getattr(module, "activation_relu_or_gelu", 0)
    if flag and flag != {"relu": 1, "gelu": 2}[found]:
        raise ValueError(
            f"{name}.activation is {found} but {name}.activation_relu_or_gelu={flag!r} makes "
            "torch's fast path use another one; build the layer with the activation you want"
        )
    return found


def torch_attention(name: str, attn: object, d_model: int) -> tuple[int, float]:
    """Check an ``nn.MultiheadAttention`` of a torch layer; return its heads and dropout."""
    require_module(name, attn, nn.MultiheadAttention)
    if not attn.batch_first:
        raise ValueError(
            f"{name} has batch_first=False, but the book's modules are batch first: the weights "
            "would copy, yet the copy would read (L, B, d_model) inputs as (B, L, d_model). "
            "Build the torch module with batch_first=True and load_state_dict(module.state_dict())"
            " into it, then copy that"
        )
    if attn.embed_dim != d_model:
        raise ValueError(f"{name}.embed_dim must be d_model={d_model}, got {attn.embed_dim}")
    if not attn._qkv_same_embed_dim:
        raise ValueError(f"{name} has kdim/vdim different from embed_dim, which is not supported")
    if attn.bias_k is not None or attn.add_zero_attn:
        raise ValueError(f"{name} uses add_bias_kv or add_zero_attn, which are not supported")
    if attn.in_proj_bias is None or attn.out_proj.bias is None:
        raise ValueError(f"{name} has no bias (bias=False); the book's layers always have biases")
    return attn.num_heads, float(attn.dropout)


def torch_linear(name: str, linear: object, in_features: int | None,
                  out_features: int | None) -> nn.Linear:
    require_module(name, linear, nn.Linear)
    for what, want, got in (("in_features", in_features, linear.in_features),
                            ("out_features", out_features, linear.out_features)):
        if want is not None and got != want:
            raise ValueError(f"{name}.{what} must be {want}, got {got}")
    if linear.bias is None:
        raise ValueError(f"{name} has no bias (bias=False); the book's layers always have biases")
    return linear


def torch_norm(name: str, norm: object, d_model: int) -> float:
    """Check an ``nn.LayerNorm`` the book's `LayerNorm` can copy exactly; return its eps."""
    require_module(name, norm, nn.LayerNorm)
    if tuple(norm.normalized_shape) != (d_model,):
        raise ValueError(f"{name} must normalize over (d_model,) = ({d_model},), got "
                         f"{tuple(norm.normalized_shape)}")
    if norm.weight is None:
        raise ValueError(f"{name} has no gain and bias (elementwise_affine=False); the book's "
                         "LayerNorm always learns both")
    if norm.bias is None:
        raise ValueError(f"{name} has no bias (bias=False); the book's LayerNorm always has one")
    return float(norm.eps)


def all_equal(what: str, values: dict[str, object]) -> object:
    """The one value in ``values`` ({name: value}); a ValueError naming each if they differ."""
    if len(set(values.values())) > 1:
        listed = ", ".join(f"{k}={v!r}" for k, v in values.items())
        raise ValueError(f"{what} must be the same everywhere to be copied, got {listed}")
    return next(iter(values.values()))


def like(new: nn.Module, module: nn.Module) -> nn.Module:
    """``new`` moved to ``module``'s dtype and device (before copying, so nothing is rounded)."""
    p = next(module.parameters())
    return new.to(dtype=p.dtype, device=p.device)


def finish_copy(new: nn.Module, module: nn.Module) -> nn.Module:
    new = like(new, module)
    new.train(module.training)
    return new


def copy_linear(dst: nn.Linear, src: nn.Linear) -> None:
    with torch.no_grad():
        dst.weight.copy_(src.weight)
        dst.bias.copy_(src.bias)


def layer_config(module: object, name: str, torch_cls: type[nn.Module],
                 cross_attention: bool) -> dict[str, object]:
    """Check that the torch layer ``module`` (a ``torch_cls``, with a ``multihead_attn`` and a
    third norm when ``cross_attention``) can be copied exactly; return the constructor
    arguments of the copy (d_model, nhead, dim_feedforward, dropout, activation,
    layer_norm_eps, norm_first)."""
    require_module(name, module, torch_cls)
    require_module(f"{name}.self_attn", module.self_attn, nn.MultiheadAttention)
    d_model = module.self_attn.embed_dim
    attn_names = ("self_attn", "multihead_attn") if cross_attention else ("self_attn",)
    heads, drops = {}, {}
    for attn in attn_names:
        heads[f"{name}.{attn}.num_heads"], drops[f"{name}.{attn}.dropout"] = torch_attention(
            f"{name}.{attn}", getattr(module, attn), d_model)
    linear1 = torch_linear(f"{name}.linear1", module.linear1, d_model, None)
    torch_linear(f"{name}.linear2", module.linear2, linear1.out_features, d_model)
    norms = ("norm1", "norm2", "norm3") if cross_attention else ("norm1", "norm2")
    eps = {f"{name}.{n}.eps": torch_norm(f"{name}.{n}", getattr(module, n), d_model)
           for n in norms}
    dropouts = ("dropout", "dropout1", "dropout2", "dropout3")[: len(norms) + 1]
    for d in dropouts:
        require_module(f"{name}.{d}", getattr(module, d), nn.Dropout)
        drops[f"{name}.{d}.p"] = float(getattr(module, d).p)
    if not isinstance(module.norm_first, bool):
        raise InputTypeError(f"{name}.norm_first must be True or False, got "
                             f"{module.norm_first!r}")
    require_uniform_parameters(name, module)
    return dict(d_model=d_model, nhead=all_equal("the number of heads", heads),
                dim_feedforward=linear1.out_features,
                dropout=all_equal("the dropout probability", drops),
                activation=torch_activation(name, module),
                layer_norm_eps=all_equal("the LayerNorm eps", eps),
                norm_first=module.norm_first)


def stack_config(module: object, name: str, torch_cls: type[nn.Module],
                 layer_config: Callable[[object, str], dict[str, object]],
                 cls_name: str) -> dict[str, object]:
    """Check that the torch stack ``module`` (a ``torch_cls``) can be copied exactly by a
    ``cls_name``, each layer checked by ``layer_config(layer, name)``; return the constructor
    arguments of the copy (the layers' and num_layers, final_norm)."""
    require_module(name, module, torch_cls)
    layers = list(module.layers)
    if not layers:
        raise ValueError(f"the {type(module).__name__} {name} has no layers to copy")
    configs = [layer_config(layer, f"{name}.layers[{i}]") for i, layer in enumerate(layers)]
    for i, config in enumerate(configs[1:], start=1):
        for key, value in config.items():
            if value != configs[0][key]:
                raise ValueError(
                    f"{name}.layers[{i}] has {key}={value!r} but {name}.layers[0] has "
                    f"{configs[0][key]!r}: {cls_name} needs every layer configured alike"
                )
    own = sum(len(list(m.parameters())) for m in [*layers, module.norm] if m is not None)
    if len(list(module.parameters())) != own:
        raise ValueError(f"{name}'s layers share parameters; the copy would give each "
                         "layer its own, untying them")
    if module.norm is not None:
        eps = torch_norm(f"{name}.norm", module.norm, configs[0]["d_model"])
        all_equal("the LayerNorm eps", {f"{name}.norm.eps": eps,
                                        f"{name}.layers[0].norm1.eps":
                                            configs[0]["layer_norm_eps"]})
    # With nested tensors and mask_check=False, torch trusts without checking that padding
    # sits at the end of each row; for any other padding mask its output is not the
    # function the layers define, and no copy can reproduce it.
    if getattr(module, "use_nested_tensor", False) and not getattr(module, "mask_check", True):
        raise ValueError(
            f"{name} uses nested tensors with mask_check=False: torch's output then depends "
            "on an unchecked promise that padding is on the right. Build it with "
            "mask_check=True or enable_nested_tensor=False"
        )
    require_uniform_parameters(name, module)
    return dict(num_layers=len(layers), **configs[0], final_norm=module.norm is not None)


def copy_multihead_attention(cls: type[nn.Module], module: object) -> nn.Module:
    """The body of `utils.attention.MultiHeadAttention.from_torch`: a ``cls`` (the book's
    multi-head attention) holding an exact copy of the ``nn.MultiheadAttention`` ``module``."""
    require_module("module", module, nn.MultiheadAttention)
    if not module._qkv_same_embed_dim:
        raise ValueError(
            f"cannot copy an nn.MultiheadAttention with kdim={module.kdim} and "
            f"vdim={module.vdim} different from embed_dim={module.embed_dim}: "
            "MultiHeadAttention takes keys and values of width d_model"
        )
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError(
            "cannot copy an nn.MultiheadAttention with add_bias_kv=True or "
            "add_zero_attn=True: both append a key MultiHeadAttention does not have"
        )
    weight = module.in_proj_weight
    in_bias = module.in_proj_bias is not None
    new = cls(module.embed_dim, module.num_heads, bias=in_bias, dropout=module.dropout)
    match_bias(new, module.out_proj)
    new = new.to(dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        for i, dst in enumerate((new.w_q, new.w_k, new.w_v)):
            dst.weight.copy_(weight.chunk(3, dim=0)[i])
            if in_bias:
                dst.bias.copy_(module.in_proj_bias.chunk(3)[i])
        new.w_o.load_state_dict(module.out_proj.state_dict())
    new.train(module.training)
    return new


def match_bias(new: nn.Module, out_proj: nn.Linear) -> None:
    """Give ``new.w_o`` a bias exactly when ``out_proj`` has one.

    Only a module whose output projection differs from its input projections needs a new
    ``w_o``; the usual case draws no extra random numbers, so seeded results stay the same.
    """
    has_bias = out_proj.bias is not None
    if (new.w_o.bias is not None) != has_bias:
        new.w_o = nn.Linear(out_proj.in_features, out_proj.out_features, bias=has_bias)


def norm_size(module: object, torch_cls: type[nn.Module]) -> int:
    """The d_model of a torch norm layer that can be copied exactly, or an error saying why not."""
    require_module("module", module, torch_cls)
    shape = tuple(module.normalized_shape)
    if len(shape) != 1:
        raise ValueError(
            f"cannot copy an nn.{torch_cls.__name__} over the last {len(shape)} dims "
            f"{shape}: only a single normalized dimension is supported"
        )
    return shape[0]


def copy_norm(new: nn.Module, module: nn.Module) -> nn.Module:
    """Move ``new`` to ``module``'s dtype and device and copy its gain (and bias) in."""
    ref = next(iter(module.parameters()), None)
    if ref is not None:
        new = new.to(dtype=ref.dtype, device=ref.device)
        with torch.no_grad():
            for name, p in module.named_parameters():
                getattr(new, name).copy_(p)
    new.train(module.training)
    return new
