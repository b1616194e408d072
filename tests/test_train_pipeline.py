"""The whole ``speculum train`` pipeline on a tiny random chat model, on the CPU, in seconds:
the data mix (greedy, sampled and long-form answers, target-written second turns, a
user's ShareGPT / OpenAI conversations, evaluation prompts kept out), EAGLE-3 with its
training-time test and the acceptance-length figures, a draft model of its own shape,
and greedy identity with both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculum import LLM, SamplingParams
from speculum.cli import main
from speculum.datasets import mt_bench as mt_bench_prompts
from speculum.testing import make_llm, tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_chat_tokenizer(path: Path, vocab_size: int = 512) -> Path:
    """A byte-level tokenizer of ``vocab_size`` ids with a ChatML template (``<|im_end|>``
    = 2, the tiny models' EOS): every byte string encodes, every id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    for c in alphabet:
        vocab[c] = len(vocab)
    pairs = (a + b for a in sorted(alphabet) for b in sorted(alphabet))
    while len(vocab) < vocab_size:  # ids past the bytes decode too (no merge makes them)
        vocab.setdefault(next(pairs), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Path:
    path = tiny_model_dir(tmp_path_factory.mktemp("chat_target"), "llama", seed=0, num_layers=4)
    return tiny_chat_tokenizer(path)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_pipeline_data_mix_ttt_and_draft_shape(chat_target, tmp_path):
    bench = mt_bench_prompts()[0]["turns"][0]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [
        {"source": "user_oriented", "prompt": "Write a poem about the sea."},
        {"source": "seed_tasks", "prompt": "List three fruits."},
        {"source": "user_oriented", "prompt": bench.upper()},  # MT-bench: never trained on
        {"source": "t0/qa", "prompt": "Context: the sky is blue. Question: what colour is the sky?"},
        {"source": "t0/qa", "prompt": "Is this review positive? Great film."},
        {"source": "t0/qa", "prompt": "Held-out question, please."},  # in --eval-prompts: dropped
    ])
    data = write_jsonl(tmp_path / "mine.jsonl", [
        {"conversations": [{"from": "human", "value": "Hi!"}, {"from": "gpt", "value": "Hello."},
                           {"from": "human", "value": "Tell me a joke."}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]},
    ])
    evals = write_jsonl(tmp_path / "eval.jsonl", [{"turns": ["held-out question, please!", "And why?"]},
                                                  {"prompt": "Another evaluation prompt."}])
    common = ["--model", str(chat_target), "--prompts", str(prompts), "--data", str(data), "--num-prompts", "10",
              "--max-tokens", "10", "--extra-answers", "2", "--extra-temperature", "0.7,1.0", "--long-form", "1",
              "--second-turns", "1.0", "--eval-prompts", str(evals), "--device", "cpu", "--cache-dir",
              str(tmp_path / "cache"), "--batch-size", "4", "--warmup", "2", "--eval-every", "0",
              "--eval-seconds", "0.3", "--val-fraction", "0.3", "--save-dtype", "float32"]
    assert main(["train", "eagle3", *common, "--steps", "12", "--num-positions", "3", "--draft-vocab", "256",
                 "--amp", "bf16", "--out", str(tmp_path / "eagle3")]) == 0
    report = json.loads((tmp_path / "eagle3" / "training.json").read_text())
    d = report["data"]
    assert d["dropped_overlaps"] == 2 and d["rows"] == 6  # 4 prompt rows + 2 conversations
    kinds = d["sequences_per_kind"]
    # answers: 6 rows; sampled: 2 per instruction row (2 prompts + 2 conversations); long: 1 per
    # prompt-file instruction row and conversation; a second turn for every single-turn row and
    # the conversation's own second turn
    assert kinds["answer"] == 6 and kinds["sampled"] == 8 and kinds["long"] == 4
    assert kinds["followup"] == 5 and kinds["turn"] == 1
    assert d["answer_tokens_per_kind"]["followup"] > 0 and report["eval_sequences"] == 3  # MT-bench-style 2 turns
    assert len(report["val_accuracy_per_position"]) == 3 and report["expected_acceptance_length"] >= 1.0
    assert report["eval_expected_acceptance_length"] >= 1.0 and report["history"]
    assert all("seconds" in h and "val_acceptance_length" in h for h in report["history"])
    cfg = json.loads((tmp_path / "eagle3" / "config.json").read_text())["speculum"]["training"]
    assert cfg["command"].startswith("speculum train eagle3") and cfg["data"]["second_turns"] == 1.0
    assert cfg["expected_acceptance_length"] == report["expected_acceptance_length"]

    # a draft of another width, trained on the same cached data
    shape = tmp_path / "shape.json"
    shape.write_text(json.dumps({"recommended": {"num_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                                                 "num_heads": 2, "num_kv_heads": 1}}))
    assert main(["train", "draft", *common, "--steps", "8", "--shape", str(shape), "--out",
                 str(tmp_path / "draft")]) == 0
    rep = json.loads((tmp_path / "draft" / "training.json").read_text())
    assert rep["data"]["generation_seconds"] == report["data"]["generation_seconds"]  # the cache, reused
    dcfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert (dcfg["num_hidden_layers"], dcfg["hidden_size"], dcfg["vocab_size"]) == (1, 32, 512)
    assert len(rep["val_accuracy_per_position"]) == 4

    # both are lossless drafts (greedy, fp32)
    p = [{"prompt_token_ids": [5, 6, 7, 8]}, [{"role": "user", "content": "Say something."}]]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base = [o.token_ids for o in make_llm(chat_target).generate(p, greedy)]
    for spec in ({"model": str(tmp_path / "eagle3"), "num_speculative_tokens": 3},
                 {"model": str(tmp_path / "draft"), "num_speculative_tokens": 3}):
        llm = make_llm(chat_target, spec)
        assert [o.token_ids for o in llm.generate(p, greedy)] == base


def test_self_prompts_are_the_targets_own_finished_requests(chat_target, tmp_path, monkeypatch):
    """`python -m speculum.train.self_prompts`: the target continues its chat template from
    where a user's message begins; the requests it ends itself are kept once each, none that
    matches an evaluation prompt, and the file trains like any prompt file (--data)."""
    import functools

    import speculum.sampling
    from speculum.train import self_prompts as sp
    from speculum.train.mix import read_rows

    # The random target alone rarely ends a request within 12 tokens, and how rarely moved with
    # the CPU's float rounding (8 of 160 here, 0 of 800 on CI's machine): a bias of 2.5 on EOS
    # (id 2) makes it end ~40% of them (~30% kept), so 32 requests hold both kinds but for ~1e-5.
    monkeypatch.setattr(speculum.sampling, "SamplingParams",
                        functools.partial(speculum.sampling.SamplingParams, logit_bias={2: 2.5}))

    llm = LLM(str(chat_target), device="cpu", dtype="float32", max_num_seqs=64)
    prefix = llm.tokenizer.user_turn_prefix()
    assert llm.tokenizer.decode(prefix, skip_special_tokens=False) == "<|im_start|>user\n"
    out = tmp_path / "self.jsonl"
    kept = sp.write_prompts(llm, 6, out, max_tokens=12, min_chars=2, batch=64, progress=False)
    r = kept.report()
    assert r["kept"] == len(read_rows(out)) > 0 and r["unfinished"] > 0  # a random model often runs to the limit
    assert r["generated"] == sum(r[k] for k in ("kept", "surplus", "unfinished", "too_short", "duplicates",
                                                 "eval_overlaps"))
    assert all(row.turns[0] and row.source == "self" for row in read_rows(out))
    report = json.loads((tmp_path / "self.jsonl.json").read_text())
    assert report["kept"] == r["kept"] and "command" in report and "prompts" not in report
    # a second run with the same seed writes the same requests (the wrong variant: what happened
    # on the H200, 2026-12-04); continued --after the first file, none of them again
    again = sp.write_prompts(llm, 6, tmp_path / "again.jsonl", max_tokens=12, min_chars=2, batch=64, progress=False)
    assert again.prompts == kept.prompts
    known, seed = sp.after([str(out)])
    assert known == kept.prompts and seed == report["seed"] + report["generated"]
    more = sp.write_prompts(llm, 6, tmp_path / "more.jsonl", max_tokens=12, min_chars=2, batch=64, progress=False,
                            seed=seed, known=known)
    assert more.prompts and not set(map(sp.normalise, more.prompts)) & set(map(sp.normalise, kept.prompts))
    # the filters, on their own: unfinished, short, repeated (after normalising), evaluation prompts
    k = sp.Kept()
    bench = mt_bench_prompts()[0]["turns"][0]
    k.add([("Write a poem.", True), ("write a poem!", True), ("cut off", False), ("hi", True),
           (bench.upper(), True), ("Plan my week.", True)], min_chars=5,
          exclude={sp.normalise(bench)})
    assert k.prompts == ["Write a poem.", "Plan my week."]
    assert (k.unfinished, k.too_short, k.duplicates, k.eval_overlaps) == (1, 1, 1, 1)
