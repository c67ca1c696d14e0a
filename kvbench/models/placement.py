"""Where each layer lives when a model spans devices (`model.device_map=auto`, accelerate).

With a device map, layer i's weights, its KV cache, its captured queries and (TailorKV) its offloaded pool's device
side all belong on layer i's device; activations cross devices only between layers, where accelerate's hooks move
them. kvbench's caches already allocate from the tensors they are given, so the one place that must move data
itself is code that runs a layer's weights on another layer's activations (TailorKV's one-layer-ahead query
prediction): it moves the activations to the layer's `execution_device` and `weights_present` loads weights offloaded
to cpu/disk.
`layer_devices` resolves an accelerate device map (module-name prefixes -> device) to one device per decoder layer,
as accelerate does: the longest matching prefix wins.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch

DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def main_device(device_map: dict[str, int | str]):
    """Where accelerate runs layers whose weights sit on "cpu" or "disk": the first GPU of the map, else the CPU
    (accelerate's `dispatch_model`). Their activations and KV cache live there too."""
    gpus = [d for d in device_map.values() if d not in ("cpu", "disk")]
    return gpus[0] if gpus else "cpu"


def as_device(where) -> torch.device:
    """An accelerate map value (GPU index, "cuda:1", "cpu") as a torch device."""
    return torch.device("cuda", where) if isinstance(where, int) else torch.device(where)


def layer_devices(device_map: dict[str, int | str], n_layers: int, prefix: str = "model.layers") -> list[torch.device]:
    """The execution device of each decoder layer `<prefix>.<i>` under an accelerate device map: the longest
    matching module prefix wins; weights offloaded to "cpu"/"disk" run on the map's main device."""
    main = main_device(device_map)
    devices = []
    for i in range(n_layers):
        name = f"{prefix}.{i}"
        matches = [k for k in device_map if k == "" or name == k or name.startswith(k + ".")]
        if matches:
            where = device_map[max(matches, key=len)]
        else:  # a map split below the layer (self_attn and mlp apart): the attention block holds the KV
            inner = sorted(k for k in device_map if k.startswith(name + ".self_attn")) or \
                    sorted(k for k in device_map if k.startswith(name + "."))
            if not inner:
                raise ValueError(f"device map: no entry places {name}; entries: {', '.join(sorted(device_map))}")
            where = device_map[inner[0]]
        devices.append(as_device(main if where in ("cpu", "disk") else where))
    return devices


def execution_device(module: torch.nn.Module) -> torch.device:
    """Where a module computes: the execution device of an accelerate hook on it or inside it (weights offloaded to
    cpu/disk sit on the meta device and are streamed there), else its first real parameter's device."""
    for sub in module.modules():
        device = getattr(getattr(sub, "_hf_hook", None), "execution_device", None)
        if device is not None:
            return as_device(device)
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def offloads_weights(module: torch.nn.Module) -> bool:
    """Whether any of `module`'s weights are offloaded to cpu/disk (accelerate), so `weights_present` must load them."""
    from accelerate.utils import has_offloaded_params

    return any(has_offloaded_params(sub) for sub in module.modules())


@contextmanager
def weights_present(module: torch.nn.Module):
    """Within the block, `module`'s weights offloaded to cpu/disk (meta tensors behind accelerate hooks) are loaded
    on their execution device, so code that reads a layer's weights outside its forward sees real tensors."""
    from accelerate.utils import align_module_device, has_offloaded_params

    with ExitStack() as stack:
        for sub in module.modules():
            if has_offloaded_params(sub):
                stack.enter_context(align_module_device(sub))
        yield
