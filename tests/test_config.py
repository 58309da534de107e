import json
import re

import numpy as np
import pytest

from glmvit_cupy import CheckpointError, NoVisionConfig, VisionGeometry, read_config
from glmvit_cupy.checks import check_grid
from glmvit_cupy.config import geometry_from_dict


def write(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_official_geometry_arithmetic():
    g = VisionGeometry.official()
    assert g.patch_dim == 3 * 2 * 14 * 14 == 1176
    assert g.merge_dim == 1024 * 2 * 2 == 4096
    assert g.head_dim == 1024 // 16 == 64
    assert g.tensor_count == 24 * 14 + 11 == 347


def test_defaults_are_the_config_class_defaults(tmp_path):
    g = read_config(write(tmp_path, {"model_type": "glm5_next", "vision_config": {}}))
    assert g == VisionGeometry()
    assert g.out_hidden_size == 1536  # Glm5NextVisionConfig's default; the release sets 4096


def test_multimodal_and_bare_and_old_model_type(tmp_path):
    v = {"model_type": "glm_ocr_vision", "out_hidden_size": 4096, "num_attention_heads": 16,
         "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}
    g = read_config(write(tmp_path, {"model_type": "glm5_next", "vision_config": v,
                                     "text_config": {"hidden_size": 4096}}))
    assert g == VisionGeometry.official()
    assert read_config(write(tmp_path, v)) == VisionGeometry.official()


def test_text_only_is_its_own_error(tmp_path):
    with pytest.raises(NoVisionConfig, match="text-only"):
        read_config(write(tmp_path, {"model_type": "glm5_next", "hidden_size": 4096}))


@pytest.mark.parametrize("fields,needle", [
    ({"num_heads": 3}, "num_heads = 3"),                              # 1024 / 3 does not tile
    ({"hidden_size": 1020, "num_heads": 10}, "head_dim = 1020 / 10 = 102"),  # 102 is not a multiple of 4
    ({"spatial_merge_size": 0}, "spatial_merge_size = 0"),      # merges m x m patches: m >= 1
    ({"spatial_merge_size": 2.0}, "spatial_merge_size = 2.0"),  # a Conv2d kernel size: an integer
    ({"spatial_merge_size": True}, "spatial_merge_size = True"),
    ({"patch_size": 0}, "patch_size = 0"),
    ({"temporal_patch_size": 0}, "temporal_patch_size = 0"),
    ({"patch_size": [[14]]}, "patch_size = [[14]]"),             # a list in the list: refused, not a TypeError
    ({"temporal_patch_size": [2, True]}, "temporal_patch_size = [2, True]"),
    ({"hidden_size": -8}, "hidden_size = -8"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps = 0.0"),
    ({"rms_norm_eps": 1e-320}, "rms_norm_eps = 1e-320 cannot work: the norms add it in float32"),  # rounds to 0
    ({"rms_norm_eps": 1e-39}, "below the least normal value (1.175e-38)"),                    # a float32 subnormal
    ({"rms_norm_eps": 1e39}, "rms_norm_eps = 1e+39 cannot work: the norms add it in float32, where it is past"),
    ({"swiglu_limit": 1e-300}, "swiglu_limit = 1e-300 cannot work: the SwiGLU clamp runs in float32"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ({"attention_bias": False}, "attention_bias = False"),
    ({"model_type": "siglip_vision_model"}, "not a GLM vision tower"),
    ({"rope_parameters": {"rope_type": "default"}}, "axial"),
])
def test_impossible_geometry_names_the_field(fields, needle):
    with pytest.raises(CheckpointError) as e:
        geometry_from_dict(fields)
    assert needle in str(e.value)


@pytest.mark.parametrize("field,value", [("swiglu_limit", "10"), ("rope_theta", None), ("rope_theta", [1e4]),
                                         ("swiglu_limit", True)])
def test_a_limit_or_theta_that_is_no_number_names_the_field(field, value):
    with pytest.raises(CheckpointError,
                       match=re.escape(f"vision_config: {field} = {value!r} cannot work: it must be a number")):
        VisionGeometry(**{field: value}).validate()
    VisionGeometry(**{field: np.float32(12.5)}).validate()  # a NumPy number is one


@pytest.mark.parametrize("fields", [{"spatial_merge_size": 300, "hidden_size": 4, "num_heads": 1},
                                    {"patch_size": 1000}, {"in_channels": 3000}, {"temporal_patch_size": 100}])
def test_a_geometry_whose_tokens_take_gigabytes_of_pixels_is_refused(fields):
    """The token limits count tokens, so a tower whose token spans (patch_size x spatial_merge_size)^2 pixels of
    many frames and channels turned a 20-token image into 1.8 M patches (23 GB) before anything said no. Such
    a geometry is refused at load, naming the product; the largest that passes still binds."""
    with pytest.raises(CheckpointError, match=r"pixel values, past the 131,072 this encoder takes"):
        geometry_from_dict(fields)
    assert VisionGeometry(in_channels=2, temporal_patch_size=1, patch_size=16, spatial_merge_size=16).validate()


def test_a_key_given_twice_or_two_names_for_one_size_that_differ_are_refused(tmp_path):
    """json keeps the last of a key given twice, and HF's alias num_hidden_layers beside depth took whichever
    came last: a config of depth 2 and 1 ran one block of two, silently. Both are refused; equal aliases pass."""
    (tmp_path / "config.json").write_text('{"model_type": "glm5_next_vision", "depth": 2, "depth": 1}')
    with pytest.raises(CheckpointError, match="config.json gives 'depth' twice in one object"):
        read_config(tmp_path)
    for alias, name in (("num_hidden_layers", "depth"), ("num_attention_heads", "num_heads")):
        for order in ((alias, name), (name, alias)):
            fields = dict([(order[0], 8), (order[1], 16)])
            with pytest.raises(CheckpointError, match=f"{name} = 16 but {alias} = 8|{name} = 8 but {alias} = 16"):
                geometry_from_dict(fields)
        assert getattr(geometry_from_dict({alias: 8, name: 8}), name) == 8


@pytest.mark.parametrize("rope", [[], 0, ""])
def test_rope_parameters_that_are_no_object_are_refused(rope):
    with pytest.raises(CheckpointError, match="rope_parameters = .* must be an object"):
        geometry_from_dict({"rope_parameters": rope})


def test_a_text_config_that_is_no_object_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="text_config = 'x' must be an object"):
        read_config(write(tmp_path, {"model_type": "glm5_next", "vision_config": {}, "text_config": "x"}))


def test_out_hidden_must_match_text_hidden(tmp_path):
    with pytest.raises(CheckpointError, match="text_config.hidden_size = 2048"):
        read_config(write(tmp_path, {"model_type": "glm5_next", "vision_config": {"out_hidden_size": 4096},
                                     "text_config": {"hidden_size": 2048}}))
    with pytest.raises(CheckpointError, match="text_config.hidden_size = '4096' must be an integer"):
        read_config(write(tmp_path, {"model_type": "glm5_next", "vision_config": {"out_hidden_size": 4096},
                                     "text_config": {"hidden_size": "4096"}}))
    with pytest.raises(CheckpointError, match="but the top-level hidden_size = 2048"):  # flat text fields: named so
        read_config(write(tmp_path, {"model_type": "glm5_next", "vision_config": {"out_hidden_size": 4096},
                                     "hidden_size": 2048}))
    with pytest.raises(CheckpointError, match="the top-level hidden_size = '4096' must be an integer"):
        read_config(write(tmp_path, {"model_type": "glm5_next", "vision_config": {"out_hidden_size": 4096},
                                     "hidden_size": "4096"}))


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_bad_config_json(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="config.json"):
        read_config(tmp_path)


def test_unreadable_config_says_so_not_bad_json(tmp_path):
    (tmp_path / "config.json").mkdir()  # a folder where the file should be
    with pytest.raises(CheckpointError, match=r"config.json: config.json is a folder, not a regular file"):
        read_config(tmp_path)


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: no such file; a checkpoint directory needs a config.json"):
        read_config(tmp_path)


@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_any_spatial_merge_size_is_a_geometry(m):
    g = geometry_from_dict({"spatial_merge_size": m})
    assert g.spatial_merge_size == m and g.merge_patches == m * m and g.merge_dim == 1024 * m * m


def test_check_grid_follows_the_merge_size():
    assert check_grid([[1, 3, 9], [2, 6, 3]], merge=3).tolist() == [[1, 3, 9], [2, 6, 3]]
    assert check_grid([[1, 1, 7]], merge=1).tolist() == [[1, 1, 7]]  # merge 1: any patch grid
    with pytest.raises(ValueError, match=r"grid_thw\[1\] = \(1, 4, 9\).*multiples of 3 .*3x3"):
        check_grid([[1, 3, 9], [1, 4, 9]], merge=3)
    with pytest.raises(ValueError, match=r"grid_thw\[0\] = \(1, 0, 3\)"):
        check_grid([[1, 0, 3]], merge=3)


def test_check_grid_accepts_and_normalises():
    grid = check_grid([[1, 32, 32], [2, 8, 6]], 2)  # a 448x448 image: 32 x 32 patches; a 2-frame video
    assert grid.dtype == np.int64 and grid.tolist() == [[1, 32, 32], [2, 8, 6]]
    assert check_grid(np.array([[1, 2, 2]], np.int32), 2).dtype == np.int64  # the smallest image: one 2x2 merge


@pytest.mark.parametrize("grid,says", [
    ([1, 32, 32], r"shape \[images, 3\]"),          # one image, but not as a row
    (np.zeros((0, 3), np.int64), r"grid_thw holds no image \(shape \(0, 3\)\); a batch has at least one"),
    ([[1.0, 32.0, 32.0]], "integer array"),
    ([[0, 32, 32]], r"grid_thw\[0\] = \(0, 32, 32\)"),   # no frames
    ([[1, 32, 32], [1, 33, 32]], r"grid_thw\[1\] = \(1, 33, 32\).*2x2"),  # odd rows cannot merge
    ([[1, 0, 0]], "positive and even"),
    (np.array([[1, 2**63, 2]], np.uint64), r"grid_thw\[0\] = \(1, 9223372036854775808, 2\): a value of magnitude"),
    ([[1, -2**40, 2]], r"\(1, -1099511627776, 2\): a value of magnitude 2\*\*31 or more"),
])
def test_check_grid_names_what_is_wrong(grid, says):
    with pytest.raises(ValueError, match=says):
        check_grid(grid, 2)


def test_a_bytes_path_reads_as_bind_tower_takes_it(tmp_path):
    import os

    v = {"model_type": "glm_ocr_vision", "out_hidden_size": 4096, "num_attention_heads": 16,
         "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}
    assert read_config(os.fsencode(write(tmp_path, v))) == VisionGeometry.official()


@pytest.mark.parametrize("key", ["depth", "model_type", "hidden_act", "rope_parameters", "attention_bias",
                                 "patch_size", "rms_norm_eps", "swiglu_limit", "rope_type", "top"])
def test_a_huge_value_is_quoted_short(tmp_path, key):
    """A megabyte string in config.json made a megabyte error line (its repr whole): quoted to 80 characters and
    counted, as the shards' errors are."""
    big = "x" * 1_000_000
    if key == "top":
        cfg = {"model_type": big}
    elif key == "rope_type":
        cfg = {"model_type": "glm5_next", "vision_config": {"rope_parameters": {"rope_type": big}}}
    else:
        cfg = {"model_type": "glm5_next", "vision_config": {key: [big] if key == "patch_size" else big}}
    with pytest.raises(CheckpointError, match=r"\.\.\. \(1,000,00\d characters\)") as e:
        read_config(write(tmp_path, cfg))
    assert len(str(e.value)) < 1_000


@pytest.mark.parametrize("field", ["depth", "hidden_size", "out_hidden_size", "patch_size", "temporal_patch_size",
                                   "spatial_merge_size"])
def test_a_size_past_any_tensors_is_refused_not_printed(tmp_path, field):
    """JSON gives integers of 4,000 digits: patch_size = 10**4000 raised a bare ValueError (its token size could not
    be printed), and the others made errors of 4,000 digits further on. Sizes past 2**40 are refused by name."""
    (tmp_path / "config.json").write_text('{"model_type": "glm5_next", "vision_config": {"%s": 1%s}}'
                                          % (field, "0" * 4_000))
    with pytest.raises(CheckpointError, match=rf"vision_config: {field} = 1000.*\(4,001 characters\) cannot work: it "
                                              r"is past 2\*\*40 \(1,099,511,627,776\)") as e:
        read_config(tmp_path)
    assert len(str(e.value)) < 1_000


@pytest.mark.parametrize("value", [[14, 14, 14], [2, 14, 14], [14]])
def test_a_patch_size_list_is_a_height_and_a_width(value):
    """A patch_size list gives a patch's [height, width]: one of another length (a Conv3d kernel's three sizes)
    is refused, not read as its first value."""
    assert geometry_from_dict({"patch_size": [7, 7]}).patch_size == 7
    with pytest.raises(CheckpointError, match=re.escape(f"patch_size = {value} cannot work: a list gives a patch's "
                                                        "[height, width]")):
        geometry_from_dict({"patch_size": value})
