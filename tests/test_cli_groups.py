"""``mxlib attribute-groups``: group attribution through the command line's entry point (``mxlib.cli.main``).

The command's numbers are ``mxlib.studies.group_attribution.attribute_groups``' own: the JSON result equals a direct
call on the same checkpoint, reference and token ids, and the printed table shows them (``group_table``). Bad
arguments end with one error line naming the option and exit code 2, nothing written.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from mxlib import checkpoints as C
from mxlib import cli
from mxlib.checkpoints.writer import attention_linears
from mxlib.models.calibration import calibrate
from mxlib.moe.linear import linear_input_amax
from mxlib.studies import group_attribution as G
from mxlib.studies import steps as W

TOKENS, SEED = 16, 3


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A tiny dummy written as a ModelOpt mixed checkpoint (NVFP4 experts, FP8 attention, bf16 lm_head) and its bf16
    reference saved as a transformers folder."""
    root = tmp_path_factory.mktemp("groups")
    model = W.dummy_model(1, seed=SEED, model_preset="tiny")
    calib = W.random_token_ids(64, SEED + 1000, model.config.vocab_size)
    cal = calibrate(model, calib)
    amax = linear_input_amax(model, calib, attention_linears(model) + ["lm_head"])
    path = C.write_mixed_checkpoint(model, "modelopt", root / "mixed", "nvfp4", "w_fp8_a_fp8", None, cal, amax)
    model.save_pretrained(root / "bf16")
    single = C.write_quantized_checkpoint(model, "w_mxfp4_a_mxfp4", root / "single")
    return path, root / "bf16", single


def _run(argv, tmp_path, capsys):
    out = tmp_path / "result.json"
    assert cli.main([*argv, "--json", str(out), "--device", "cpu"]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_checkpoint_folder_gives_the_functions_numbers(mixed, tmp_path, capsys):
    path, ref_dir, _ = mixed
    argv = ["attribute-groups", str(path), "--reference", str(ref_dir), "--tokens", str(TOKENS), "--seed", str(SEED)]
    argv += ["--targets", "FP8=bf16", "--backend", "torch"]
    result, out = _run(argv, tmp_path, capsys)

    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.bfloat16, local_files_only=True).eval()
    model, _ = C.load_quantized_moe(path, backend="torch")
    ids = W.random_token_ids(TOKENS, SEED + 1, reference.config.vocab_size)
    direct = G.attribute_groups(model, reference, ids, targets={"FP8": "bf16"})
    assert (
        result["groups"]
        == direct["groups"]
        == {
            "NVFP4 g16": ["model.layers.0.mlp.experts"],
            "FP8": [f"model.layers.0.self_attn.{p}" for p in C.ATTENTION_PROJS],
        }
    )
    assert result["values"] == direct["values"]
    assert result["decompositions"] == json.loads(json.dumps(direct["decompositions"]))
    assert {k: v["verdict"] for k, v in result["decisions"].items()} == {
        k: v["verdict"] for k, v in direct["decisions"].items()
    }
    assert result["schemes"] == {"NVFP4 g16": "nvfp4", "FP8": "w_fp8_a_fp8"}
    assert result["bf16_matches_reference"] is True
    nsr = direct["decompositions"]["logits nsr"]
    for g in direct["groups"]:
        line = next(line for line in out.splitlines() if line.startswith(g + " "))
        assert f"{nsr['singles'][g]:.4e}" in line and f"{nsr['switches'][g]:.4e}" in line
    assert f"{nsr['targets']['FP8 as bf16']:+.4e} vs all" in out
    assert G.group_table(direct, result["schemes"]) in out


def test_dummy_model_by_default(tmp_path, capsys):
    argv = ["attribute-groups", "--preset", "tiny", "--layers", "1", "--tokens", str(TOKENS)]
    argv += ["--producer", "compressed-tensors", "--experts", "nvfp4", "--lm-head", "none", "--draws", "2"]
    result, out = _run(argv, tmp_path, capsys)
    assert result["source"] == {
        "dummy": "tiny",
        "layers": 1,
        "seed": 0,
        "producer": "compressed-tensors",
        "experts": "nvfp4",
        "attention": "w_mxfp8_a_mxfp8",
        "lm_head": "none",
    }
    assert result["schemes"] == {"group_0": "nvfp4", "group_1": "w_mxfp8_a_mxfp8"}
    assert result["draws"] == 2 and result["n"] == 2 * TOKENS and result["bf16_matches_reference"]
    assert "decided over token sets" in out
    assert G.group_residuals(result["decompositions"]["logits nsr"]) == {"waterfall": 0.0, "groups": 0.0}


@pytest.mark.parametrize(
    "argv,message",
    [
        (["{path}"], "--reference: PATH needs the bf16 checkpoint folder it was quantized from"),
        (["{path}", "--reference", "{path}", "--producer", "quark"], "--producer: build the dummy model's checkpoint"),
        (["{path}", "--reference", "{path}/nope"], "--reference: .* has no config.json"),
        (["{single}", "--reference", "{ref}"], "path: .* is a single-scheme checkpoint \\(w_mxfp4_a_mxfp4\\)"),
        (["/nonexistent/mixed"], "path: '/nonexistent/mixed' does not exist"),
        (["--reference", "{ref}"], "--reference: given without PATH"),
        (["--targets", "noequals"], "--targets: expected GROUP=SCHEME items"),
        (["--targets", "g=w_nope"], "--targets: 'g=w_nope': scheme: unknown MoE scheme 'w_nope'"),
        (["--experts", "w_fp8_a_fp8"], "--experts: w_fp8_a_fp8 is a linear-layer scheme"),
        (["--experts", "bogus"], "argument --experts: invalid choice: 'bogus'"),
        (["--producer", "awq"], "argument --producer: invalid choice: 'awq'"),
        (["--draws", "0"], "argument --draws: expected a positive integer"),
        (["--layers", "0"], "argument --layers: expected a positive integer"),
        (
            ["--preset", "tiny", "--layers", "1", "--targets", "nope=bf16"],
            "--targets: \\['nope'\\] not precision groups",
        ),
        (
            ["--producer", "modelopt", "--experts", "w_mxfp4"],
            "--experts: modelopt mixed checkpoints store .*got w_mxfp4",
        ),
        (
            ["--attention", "none", "--lm-head", "none"],
            "--attention, --lm-head: both 'none' leaves one precision group",
        ),
        (["--preset", "tiny", "--layers", "1", "--order", "lm_head"], "--order: expected every precision group once"),
        (
            ["--preset", "tiny", "--layers", "1", "--targets", "global_quant_config=w_fp8_a_fp8"],
            "--targets: global_quant_config=w_fp8_a_fp8: w_fp8_a_fp8 is a linear-layer scheme",
        ),
    ],
)
def test_bad_arguments_are_one_error_line(argv, message, mixed, tmp_path, capsys):
    path, ref_dir, single = mixed
    argv = [a.format(path=path, ref=ref_dir, single=single) for a in argv]
    out = tmp_path / "never.json"
    with pytest.raises(SystemExit) as exc:
        cli.main(["attribute-groups", *argv, "--device", "cpu", "--json", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mxlib attribute-groups: error:") and len(err.splitlines()) == 1, err

    assert re.search(message, err), err
    assert not out.exists()


def test_the_full_size_preset_is_accepted():
    """``--preset qwen3-30b-a3b`` passes every check (nothing is built here: the study at that shape takes 6
    minutes and 18 GB on two cores; its run is in docs/attribution.md)."""
    from mxlib.cli._prechecks import precheck
    from mxlib.cli.group_commands import check_attribute_groups

    ap, _ = cli.build_parser()
    args = ap.parse_args(["attribute-groups", "--preset", "qwen3-30b-a3b", "--targets", "lm_head=nvfp4"])
    precheck(args)
    check_attribute_groups(args)
    assert (args.preset, args.layers, args.producer, args.target_map) == (
        "qwen3-30b-a3b",
        4,
        "quark",
        {"lm_head": ["nvfp4"]},
    )
