"""Preference pairs for DPO (mindspeed_rl/data/pairwise.py): MindSpeed-RL's alpaca pairwise
layout and its map_keys, the token ids a pair trains on, the packed indexed pairwise dataset
and the preprocessing tool (round trips), and every bad input as an error naming the row and
the key (in-process, tiny word-level tokenizer as tests/test_data.py, no downloads)."""

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from mindspeed_rl.data import PairItem, load_pair_dataset, load_prompt_dataset

REPO = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} "
                 "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant "
                 "{% endif %}")
WORDS = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "What",
         "is", "?", "Be", "brief.", "Hi", "Yes", "No", "Sure", "a", "b", "+", "-", "*"] + \
    [str(i) for i in range(50)]
EOS = WORDS.index("<|im_end|>")


def make_tokenizer(chat_template=CHAT_TEMPLATE, eos_token="<|im_end|>"):
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                  eos_token=eos_token,
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = chat_template
    return tok


def ids(text):
    return [WORDS.index(w) for w in text.split()]


# MindSpeed-RL's alpaca column names (instruction / input / chosen / rejected)
ALPACA = [{"instruction": "What is 3 + 4 ?", "input": "Be brief.", "chosen": "7", "rejected": "8"},
          {"instruction": "What is 2 * 5 ?", "input": "", "chosen": "10", "rejected": "12 No"},
          {"instruction": "Hi", "chosen": "Hi", "rejected": "No"}]  # no input: prompt alone
# Intel/orca_dpo_pairs' columns, read with the map_keys of MindSpeed-RL's orca_rlhf dataset config
ORCA = [{"system": "Be brief.", "question": "What is 1 + 1 ?", "chosen": "2", "rejected": "3",
         "input": "a"},  # not read: map_keys query "" says the file has no query
        {"system": "", "question": "Hi", "chosen": "Sure", "rejected": "No"}]
ORCA_KEYS = {"prompt": "question", "query": "", "system": "system"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _triples(ds):
    return [(it.prompt_ids, it.chosen_ids, it.rejected_ids, it.source_row) for it in ds]


def _load_tool(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_alpaca_pairs_prompt_query_and_responses(tmp_path):
    ds = load_pair_dataset(write_jsonl(tmp_path / "p.jsonl", ALPACA), make_tokenizer(), 64,
                           shuffle=False)
    assert len(ds) == 3 and all(isinstance(it, PairItem) for it in ds)
    first = ds[0]
    # the query follows the instruction after a newline; the generation prompt ends it
    assert first.prompt_text == ("<|im_start|> user What is 3 + 4 ?\nBe brief. <|im_end|> "
                                 "<|im_start|> assistant ")
    assert first.prompt_ids == ids("<|im_start|> user What is 3 + 4 ? Be brief. <|im_end|> "
                                   "<|im_start|> assistant")
    # each response ends with eos, as a sampled one does
    assert (first.chosen_ids, first.rejected_ids) == (ids("7") + [EOS], ids("8") + [EOS])
    assert ds[1].prompt_ids == ids("<|im_start|> user What is 2 * 5 ? <|im_end|> "
                                   "<|im_start|> assistant")  # empty input: instruction only
    assert ds[1].rejected_ids == ids("12 No <|im_end|>")
    assert ds[2].prompt_ids == ids("<|im_start|> user Hi <|im_end|> <|im_start|> assistant")
    assert [it.source_row for it in ds] == [0, 1, 2]
    assert first.source_file.endswith("p.jsonl")


def test_orca_map_keys_system_first(tmp_path):
    path = tmp_path / "orca.parquet"
    pq.write_table(pa.Table.from_pylist(ORCA), path)
    tok = make_tokenizer()
    ds = load_pair_dataset(str(path), tok, 64, map_keys=ORCA_KEYS, shuffle=False)
    assert ds[0].prompt_ids == ids("<|im_start|> system Be brief. <|im_end|> <|im_start|> user "
                                   "What is 1 + 1 ? <|im_end|> <|im_start|> assistant")
    assert ds[1].prompt_ids == ids("<|im_start|> user Hi <|im_end|> <|im_start|> assistant")
    # the same ids as transformers' own templating
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 1 + 1 ?"}]
    assert ds[0].prompt_ids == list(tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert (ds[0].chosen_ids, ds[0].rejected_ids) == (ids("2") + [EOS], ids("3") + [EOS])


def test_history_turns_and_raw_text_without_template(tmp_path):
    rows = [{"instruction": "What is 1 + 1 ?", "chosen": "2", "rejected": "3", "sys": "Be brief.",
             "turns": [["Hi", "Sure"]]}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    ds = load_pair_dataset(path, make_tokenizer(), 64, map_keys={"system": "sys",
                                                                  "history": "turns"})
    assert ds[0].prompt_ids == ids(
        "<|im_start|> system Be brief. <|im_end|> <|im_start|> user Hi <|im_end|> <|im_start|> "
        "assistant Sure <|im_end|> <|im_start|> user What is 1 + 1 ? <|im_end|> <|im_start|> "
        "assistant")
    raw = load_pair_dataset(path, make_tokenizer(chat_template=None), 64,
                            map_keys={"system": "sys"}, apply_chat_template=False)
    assert raw[0].prompt_text == "Be brief.\n\nWhat is 1 + 1 ?"
    assert raw[0].prompt_ids == ids("Be brief. What is 1 + 1 ?")
    with pytest.raises(ValueError, match=r"row 0 of .*p\.jsonl: 'turns' holds earlier turns"):
        load_pair_dataset(path, make_tokenizer(), 64, map_keys={"history": "turns"},
                          apply_chat_template=False)


def test_eos_not_doubled_and_tokenizer_without_eos(tmp_path):
    rows = [{"instruction": "Hi", "chosen": "Sure <|im_end|>", "rejected": "No"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    assert load_pair_dataset(path, make_tokenizer(), 64)[0].chosen_ids == ids("Sure <|im_end|>")
    with pytest.raises(ValueError, match="has no eos_token"):
        load_pair_dataset(path, make_tokenizer(eos_token=None), 64)


def test_pairs_order_is_resumable(tmp_path):
    ds = load_pair_dataset(write_jsonl(tmp_path / "p.jsonl", ALPACA), make_tokenizer(), 64,
                           seed=5)
    probe = load_pair_dataset(write_jsonl(tmp_path / "p.jsonl", ALPACA), make_tokenizer(), 64,
                              seed=5)
    first = [[it.source_row for it in ds.next_batch(2)] for _ in range(3)]
    probe.next_batch(2)
    resumed = load_pair_dataset(write_jsonl(tmp_path / "p.jsonl", ALPACA), make_tokenizer(), 64,
                                seed=5)
    resumed.load_state_dict(probe.state_dict())
    assert [[it.source_row for it in resumed.next_batch(2)] for _ in range(2)] == first[1:]
    with pytest.raises(ValueError, match="between 1 and the 3 pairs of"):
        ds.next_batch(4)
    with pytest.raises(ValueError, match=r"is for 4 pairs but .* has 3; resume with the same "
                                         r"data$"):
        ds.load_state_dict({"epoch": 0, "offset": 0, "seed": 5, "num_prompts": 4})


def test_packed_pairs_written_by_the_tool_and_read_back(tmp_path, capsys):
    """The tool writes MindSpeed-RL's packed pairwise format with megatron-core's builder;
    data_path = its prefix reads the same pairs as the jsonl."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tok_dir = tmp_path / "tok"
    make_tokenizer().save_pretrained(str(tok_dir))
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    source = write_jsonl(tmp_path / "p.jsonl", ALPACA)
    prefix = tmp_path / "packed" / "dpo"
    tool = _load_tool("preprocess_data")
    assert tool.main(["--handler-name", "AlpacaStylePairwiseHandler", "--input", source,
                      "--output-prefix", str(prefix), "--tokenizer", str(tok_dir),
                      "--seq-length", "64"]) == 0
    assert "wrote 3 pairs" in capsys.readouterr().out
    direct = load_pair_dataset(source, tok, 64, shuffle=False)
    labels = IndexedDataset(f"{prefix}_packed_chosen_labels_document")
    inputs = IndexedDataset(f"{prefix}_packed_rejected_input_ids_document")
    assert labels[0].tolist() == [-100] * len(direct[0].prompt_ids) + direct[0].chosen_ids
    assert inputs[1].tolist() == direct[1].prompt_ids + direct[1].rejected_ids
    packed = load_pair_dataset(str(prefix), tok, 64, shuffle=False)
    assert _triples(packed) == _triples(direct)
    assert packed[0].prompt_text == tok.decode(direct[0].prompt_ids)
    assert _triples(load_pair_dataset(str(prefix), None, 64, shuffle=False)) == _triples(direct)
    # the parquet output reads back without a tokenizer, texts kept
    out = tmp_path / "p.parquet"
    assert tool.main(["--handler-name", "AlpacaStylePairwiseHandler", "--input", source,
                      "--output", str(out), "--tokenizer", str(tok_dir)]) == 0
    pre = load_pair_dataset(str(out), None, 64, shuffle=False)
    assert _triples(pre) == _triples(direct)
    assert [it.prompt_text for it in pre] == [it.prompt_text for it in direct]


def test_preprocess_tool_pairwise_errors(tmp_path, capsys):
    tok_dir = tmp_path / "tok"
    make_tokenizer().save_pretrained(str(tok_dir))
    tool = _load_tool("preprocess_data")
    source = write_jsonl(tmp_path / "orca.jsonl", ORCA)
    base = ["--handler-name", "AlpacaStylePairwiseHandler", "--input", source,
            "--output-prefix", str(tmp_path / "dpo"), "--tokenizer", str(tok_dir)]
    assert tool.main(base + ["--map-keys", json.dumps(ORCA_KEYS)]) == 0
    assert tool.main(base) == 2  # orca has no 'instruction': map_keys.prompt is needed
    assert "row 0 of" in capsys.readouterr().err
    assert tool.main(base + ["--map-keys", json.dumps(ORCA_KEYS), "--seq-length", "5"]) == 2
    assert "> seq_length 5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.parse_args(base + ["--max-prompt-length", "8"])


def _write_packed(prefix, docs):
    """Write chosen/rejected (input_ids, labels) documents as MindSpeed-RL's handler does."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    fields = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
    for i, field in enumerate(fields):
        path = f"{prefix}_packed_{field}_document"
        builder = IndexedDatasetBuilder(path + ".bin", dtype=np.int32)
        for doc in docs:
            builder.add_item(torch.tensor(doc[i]))
            builder.end_document()
        builder.finalize(path + ".idx")


def test_packed_pairs_as_mindspeed_rl_writes_them(tmp_path):
    prompt = ids("<|im_start|> user Hi <|im_end|> <|im_start|> assistant")
    good = ids("Sure <|im_end|>")
    bad = ids("No <|im_end|>")
    hidden = [-100] * len(prompt)
    _write_packed(tmp_path / "dpo", [(prompt + good, hidden + good, prompt + bad, hidden + bad)])
    ds = load_pair_dataset(str(tmp_path / "dpo"), make_tokenizer(), 16)
    assert (ds[0].prompt_ids, ds[0].chosen_ids, ds[0].rejected_ids) == (prompt, good, bad)
    assert ds[0].source_row == 0 and ds[0].source_file == str(tmp_path / "dpo")


# ---- bad input: one-line errors naming the file, the row and the key -----------------------

BAD_ROWS = [
    ("empty chosen", [ALPACA[0], {"instruction": "Hi", "chosen": "", "rejected": "No"}], None,
     r"row 1 of .*p\.jsonl: the 'chosen' response is empty"),
    ("blank rejected", [{"instruction": "Hi", "chosen": "Sure", "rejected": "  "}], None,
     r"row 0 of .*p\.jsonl: the 'rejected' response is empty"),
    ("identical",
     [ALPACA[0], ALPACA[1], {"instruction": "Hi", "chosen": "Sure", "rejected": "Sure"}], None,
     r"row 2 of .*p\.jsonl: 'chosen' and 'rejected' are the same response"),
    ("identical, mapped names", [{"q": "Hi", "good": "Yes", "bad": "Yes"}],
     {"prompt": "q", "chosen": "good", "rejected": "bad"},
     r"row 0 of .*p\.jsonl: 'good' and 'bad' are the same response"),
    ("missing rejected in a row", [ALPACA[0], {"instruction": "Hi", "chosen": "Sure"}], None,
     r"row 1 of .*p\.jsonl has no 'rejected' field"),
    ("empty prompt", [{"instruction": " ", "input": "", "chosen": "a", "rejected": "b"}], None,
     r"row 0 of .*p\.jsonl has an empty prompt \('instruction' \+ 'input'\)"),
    ("a prompt file given to DPO", [{"prompt": "What is 1 + 1 ?", "answer": "2"}], None,
     r"row 0 of .*p\.jsonl has no 'chosen' column .*prompt files \(prompt \+ answer\) train "
     r"with pretrain_grpo\.py"),
    ("no instruction column", [{"question": "Hi", "chosen": "a", "rejected": "b"}], None,
     r"row 0 of .*p\.jsonl has no 'instruction' column .*name the prompt's column in map_keys"),
    ("map_keys names a missing column", ORCA, {"prompt": "query_text", "system": "system"},
     r"row 0 of .*p\.jsonl has no 'query_text' column, which map_keys\.prompt names"),
    ("map_keys response", ALPACA, {"response": "chosen"},
     r"map_keys names \['response'\]; pairwise data has no single response"),
    ("chosen not text", [{"instruction": "Hi", "chosen": ["a"], "rejected": "b"}], None,
     r"row 0 of .*p\.jsonl: 'chosen' must be a string"),
]


@pytest.mark.parametrize("rows, map_keys, message", [case[1:] for case in BAD_ROWS],
                         ids=[case[0] for case in BAD_ROWS])
def test_bad_rows_name_the_row_and_key(tmp_path, rows, map_keys, message):
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(ValueError, match=message) as error:
        load_pair_dataset(path, make_tokenizer(), 64, map_keys=map_keys)
    assert "\n" not in str(error.value)


def test_pair_longer_than_seq_length_names_both_numbers(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ALPACA)
    # row 0: prompt 13 tokens, chosen "7" + eos = 2 tokens (as long as rejected: chosen named)
    assert len(load_pair_dataset(path, make_tokenizer(), 15)) == 3
    with pytest.raises(ValueError, match=r"row 0 of .*p\.jsonl: prompt \(13 tokens\) \+ the "
                                         r"longer response 'chosen' \(2 tokens\) = 15 tokens "
                                         r"> seq_length 14; raise megatron_training.seq_length"):
        load_pair_dataset(path, make_tokenizer(), 14)
    # row 1: prompt 11 tokens, rejected "12 No" + eos = 3 tokens, longer than chosen's 2
    path = write_jsonl(tmp_path / "p.jsonl", [ALPACA[2], ALPACA[1]])
    with pytest.raises(ValueError, match=r"row 1 of .*p\.jsonl: prompt \(11 tokens\) \+ the "
                                         r"longer response 'rejected' \(3 tokens\) = 14 tokens "
                                         r"> seq_length 13"):
        load_pair_dataset(path, make_tokenizer(), 13)


def test_bad_packed_documents(tmp_path):
    prompt, other = ids("<|im_start|> user Hi <|im_start|> assistant"), ids("user Hi")
    good, bad = ids("Sure <|im_end|>"), ids("No <|im_end|>")
    hide = [-100] * len(prompt)
    _write_packed(tmp_path / "a", [(prompt + good, hide + good, prompt + bad, hide + bad),
                                   (prompt + good, hide + good, other + bad,
                                    [-100] * len(other) + bad)])
    with pytest.raises(ValueError, match=r"document 1 of .*a_packed_\*: the chosen and the "
                                         r"rejected sequence have different prompts"):
        load_pair_dataset(str(tmp_path / "a"), None, 64)
    _write_packed(tmp_path / "b", [(prompt + good, hide + good, prompt + bad, hide + [-100] * 2)])
    with pytest.raises(ValueError, match=r"document 0 of .*b_packed_rejected_labels_document: "
                                         r"every label is -100, so the 'rejected' response is "
                                         r"empty"):
        load_pair_dataset(str(tmp_path / "b"), None, 64)
    _write_packed(tmp_path / "c", [(prompt + good, hide + good, prompt + good, hide + good)])
    with pytest.raises(ValueError, match=r"document 0 of .*c_packed_\*: 'chosen' and 'rejected' "
                                         r"are the same response"):
        load_pair_dataset(str(tmp_path / "c"), None, 64)
    _write_packed(tmp_path / "d", [(prompt + good, hide + good, prompt + bad, hide + bad)])
    assert len(load_pair_dataset(str(tmp_path / "d"), None, 7)) == 1
    with pytest.raises(ValueError, match=r"document 0 of .*d_packed_\*: prompt \(5 tokens\) .* "
                                         r"= 7 tokens > seq_length 6"):
        load_pair_dataset(str(tmp_path / "d"), None, 6)


def test_bad_pre_tokenized_pairs(tmp_path):
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"prompt_ids": [[2, 4], [2, 4]], "chosen_ids": [[7, 3], []],
                             "rejected_ids": [[8, 3], [8, 3]]}), path)
    with pytest.raises(ValueError, match=r"row 1 of .*pairs\.parquet: the 'chosen_ids' response "
                                         r"is empty"):
        load_pair_dataset(str(path), None, 64)


def test_pairwise_data_given_to_grpo_and_prompt_data_given_to_dpo(tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl",
                        [{"prompt": "Hi", "chosen": "Sure", "rejected": "No"}])
    with pytest.raises(ValueError, match=r"row 0 of .*pairs\.jsonl has 'chosen' and 'rejected' "
                                         r"fields and no 'answer' field: it is a pairwise \(DPO\) "
                                         r"file, which trains with pretrain_dpo\.py"):
        load_prompt_dataset(pairs, make_tokenizer(), 64)
    # a prompt file that happens to carry the pair columns still loads: it has its answers
    extra = write_jsonl(tmp_path / "extra.jsonl",
                        [{"prompt": "Hi", "answer": "a", "chosen": "Sure", "rejected": "No"}])
    assert load_prompt_dataset(extra, make_tokenizer(), 64)[0].answer == "a"
    # the packed formats: each loader names the other's launcher
    _write_packed(tmp_path / "dpo", [(ids("Hi a"), [-100, 16], ids("Hi b"), [-100, 17])])
    with pytest.raises(ValueError, match=r"dpo is a pairwise \(DPO\) packed dataset.*"
                                         r"pretrain_dpo\.py"):
        load_prompt_dataset(str(tmp_path / "dpo"), make_tokenizer(), 64)
    from mindspeed_rl.data.indexed import write_indexed_prompts
    write_indexed_prompts(str(tmp_path / "grpo"), [(ids("Hi"), ids("a"))])
    with pytest.raises(ValueError, match=r"grpo is a prompt \(GRPO\) packed dataset .*"
                                         r"pretrain_grpo\.py"):
        load_pair_dataset(str(tmp_path / "grpo"), make_tokenizer(), 64)
    with pytest.raises(FileNotFoundError, match=r"no packed pairwise dataset .*nothing_packed_"
                                                r"chosen_input_ids_document\.idx"):
        load_pair_dataset(str(tmp_path / "nothing"), make_tokenizer(), 64)
