"""HF transformers' bf16 forward of a checkpoint on the GPU: the accuracy bar for the GPU tests.

Needs torch with CUDA and transformers 5.23.0 (the GPU machine has both; CI has neither).
"""

import numpy as np


def available(device="cuda") -> str | None:
    """None when HF's forward can run on `device`, else why not."""
    try:
        import torch
        import transformers
    except ImportError as e:
        return f"torch/transformers not importable ({e})"
    if transformers.__version__ != "5.23.0":
        return f"transformers {transformers.__version__} is not the reference 5.23.0"
    if device == "cuda" and not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


_models = {}


def hf_model(binding, dtype_name="bfloat16", device="cuda"):
    import torch
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextVisionConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    key = (binding.path, dtype_name, device)
    if key not in _models:
        g = binding.geometry
        cfg = Glm5NextVisionConfig(depth=g.depth, hidden_size=g.hidden_size, num_heads=g.num_heads,
                                   intermediate_size=g.intermediate_size, out_hidden_size=g.out_hidden_size,
                                   projection_intermediate_size=g.projection_intermediate_size,
                                   swiglu_limit=g.swiglu_limit, rms_norm_eps=g.rms_norm_eps,
                                   patch_size=g.patch_size, temporal_patch_size=g.temporal_patch_size,
                                   in_channels=g.in_channels, spatial_merge_size=g.spatial_merge_size,
                                   rope_parameters={"rope_type": "axial", "rope_theta": g.rope_theta})
        cfg._attn_implementation = "sdpa"
        dtype = getattr(torch, dtype_name)
        with torch.device("meta"):
            model = Glm5NextVisionModel(cfg)
        state = {}
        for s in binding.layout:
            arr = binding.store.get(binding.prefix + s)
            bits = np.array(arr, copy=True).view(np.int16)  # a writable copy: torch wants one
            state[s] = torch.from_numpy(bits).view(torch.bfloat16).to(dtype)
        model.load_state_dict(state, strict=False, assign=True)
        model.rotary_pos_emb.__init__(cfg)  # non-persistent buffers were left on meta
        _models[key] = model.to(device).eval()
    return _models[key]


def hf_forward(binding, pixel_values, grid_thw, dtype_name="bfloat16", device="cuda"):
    import torch

    model = hf_model(binding, dtype_name, device)
    with torch.no_grad():
        out = model(hidden_states=torch.from_numpy(np.asarray(pixel_values, np.float32)).to(device, model.dtype),
                    grid_thw=torch.from_numpy(np.asarray(grid_thw, np.int64)).to(device))
    return out.pooler_output.float().cpu().numpy()
