"""Prompt files, chat templates, length filter, errors, resumable order, arithmetic set,
and the preprocessing tool (in-process, tiny word-level tokenizer, no downloads)."""

import importlib.util
import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from mindspeed_rl.data import (PromptDataset, PromptItem, load_prompt_dataset,
                               make_arithmetic_problems, slice_per_dp_rank)

REPO = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} "
                 "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant "
                 "{% endif %}")
WORDS = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "What",
         "is", "?", "Be", "brief.", "Hi", "a", "b"] + [str(i) for i in range(200)] + ["+", "-", "*"]


def make_tokenizer(chat_template=CHAT_TEMPLATE):
    vocab = {w: i for i, w in enumerate(WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = chat_template
    return tok


def ids(text):
    vocab = {w: i for i, w in enumerate(WORDS)}
    return [vocab[w] for w in text.split()]


ROWS = [{"prompt": "What is 3 + 4 ?", "answer": "7"},
        {"prompt": "What is 10 * 2 ?", "answer": 20},  # a number answer becomes "20"
        {"prompt": "Hi", "answer": "b"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_with_chat_template(tmp_path):
    ds = load_prompt_dataset(write_jsonl(tmp_path / "p.jsonl", ROWS), make_tokenizer(), 64)
    assert len(ds) == 3 and ds.num_dropped == 0
    item = ds[0]
    assert item.prompt_text == ("<|im_start|> user What is 3 + 4 ? <|im_end|> "
                                "<|im_start|> assistant ")
    assert item.prompt_ids == ids("<|im_start|> user What is 3 + 4 ? <|im_end|> <|im_start|> "
                                  "assistant")
    assert [it.answer for it in ds] == ["7", "20", "b"]
    assert item.source_row == 0 and item.source_file.endswith("p.jsonl")


def test_prompts_are_cut_to_seq_length(tmp_path):
    """As MindSpeed-RL reads its prompt data: longer than max_prompt_length dropped, then
    longer than seq_length (cut_to) cut to the first seq_length tokens."""
    # token counts of the three templated prompts: 11, 11 and 6
    ds = load_prompt_dataset(write_jsonl(tmp_path / "p.jsonl", ROWS), make_tokenizer(), 10,
                             cut_to=8)
    assert len(ds) == 1 and ds.num_dropped == 2          # 11 > 10: dropped
    ds = load_prompt_dataset(write_jsonl(tmp_path / "p.jsonl", ROWS), make_tokenizer(), 64,
                             cut_to=8)
    whole = ids("<|im_start|> user What is 3 + 4 ? <|im_end|> <|im_start|> assistant")
    assert ds[0].prompt_ids == whole[:8] and len(ds[2].prompt_ids) == 6   # 6 <= 8: whole
    assert ds[0].prompt_text == "<|im_start|> user What is 3 + 4 ?"     # the text of the cut


def test_ids_match_apply_chat_template_tokenize(tmp_path):
    # Rendering then encoding without special tokens is what tokenize=True does.
    tok = make_tokenizer()
    ds = load_prompt_dataset(write_jsonl(tmp_path / "p.jsonl", ROWS), tok, 64)
    for row, item in zip(ROWS, ds):
        expected = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
        assert item.prompt_ids == list(expected)


def test_json_array_chat_messages_and_system_prompt(tmp_path):
    rows = [{"q": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
             "a": "x"},
            {"q": "Hi", "a": "y"}]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(rows))
    ds = load_prompt_dataset(str(path), make_tokenizer(), None, prompt_key="q", answer_key="a",
                             system_prompt="Be brief.")
    expected = "<|im_start|> system Be brief. <|im_end|> <|im_start|> user Hi <|im_end|> " \
               "<|im_start|> assistant "
    # the row's own system message is kept, the plain prompt gets system_prompt
    assert ds[0].prompt_text == expected and ds[1].prompt_text == expected


def test_parquet_and_raw_text_without_template(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["What is 3 + 4 ?"], "answer": ["7"]}), path)
    ds = load_prompt_dataset(str(path), make_tokenizer(chat_template=None), 64,
                             apply_chat_template=False)
    assert ds[0].prompt_text == "What is 3 + 4 ?"
    assert ds[0].prompt_ids == ids("What is 3 + 4 ?")  # this tokenizer adds no BOS


def test_directory_of_files(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ROWS[:2])
    write_jsonl(tmp_path / "b.jsonl", ROWS[2:])
    ds = load_prompt_dataset(str(tmp_path), make_tokenizer(), 64)
    assert [it.answer for it in ds] == ["7", "20", "b"]
    assert ds[2].source_file.endswith("b.jsonl") and ds[2].source_row == 0


def test_long_prompts_dropped_and_counted(tmp_path, caplog):
    # with the template: "What is 3 + 4 ?" -> 11 tokens, "Hi" -> 6 tokens
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    with caplog.at_level(logging.WARNING, logger="mindspeed_rl.data.prompts"):
        ds = load_prompt_dataset(path, make_tokenizer(), 7)
    assert len(ds) == 1 and ds.num_dropped == 2 and ds[0].answer == "b"
    assert "1 prompts kept, 2 dropped as longer than max_prompt_length=7" in caplog.text
    with pytest.raises(ValueError, match="all 3 prompts .* longer than max_prompt_length=3"):
        load_prompt_dataset(path, make_tokenizer(), 3)


def test_missing_file_error(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError,
                       match=f"data file {missing} not found; set megatron_training.data_path"):
        load_prompt_dataset(str(missing), make_tokenizer(), 64)
    with pytest.raises(FileNotFoundError, match="test_data_path"):
        load_prompt_dataset(str(missing), make_tokenizer(), 64,
                            data_path_key="megatron_training.test_data_path")


def test_row_without_prompt_field(tmp_path):
    rows = [dict(ROWS[0]) for _ in range(20)]
    rows[17] = {"question": "Hi", "answer": "1"}
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(ValueError, match=r"row 17 of .*p\.jsonl has no 'prompt' field "
                                         r"\(keys: \['answer', 'question'\]\); "
                                         r"set megatron_training.prompt_key"):
        load_prompt_dataset(path, make_tokenizer(), 64)
    with pytest.raises(ValueError, match=r"row 0 of .* has no 'solution' field .*answer_key"):
        load_prompt_dataset(path, make_tokenizer(), 64, answer_key="solution")


def test_bad_prompt_type(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": 5, "answer": "1"}])
    with pytest.raises(ValueError, match="row 0 of .*'prompt' must be a string or a list of chat"):
        load_prompt_dataset(path, make_tokenizer(), 64)


def test_rows_are_read_as_written(tmp_path):
    """Each message keeps exactly its own keys (a chat template that asks whether
    ``tool_calls`` is defined must not see one filled in from another row); a string may
    hold U+2028 or a form feed (not line ends in JSON lines); blank lines are no rows; a
    JSON array in a .jsonl file is its rows."""
    from mindspeed_rl.data.prompts import read_prompt_rows

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "a\u2028b\x0cc"}],
                                "answer": 1}, ensure_ascii=False) + "\n\n"
                    + json.dumps({"prompt": [{"role": "user", "content": "Hi", "name": "x"}],
                                  "answer": "b"}) + "\n")
    rows = read_prompt_rows(str(path))
    assert [r.prompt for r in rows] == [[{"role": "user", "content": "a\u2028b\x0cc"}],
                                        [{"role": "user", "content": "Hi", "name": "x"}]]
    assert [r.answer for r in rows] == ["1", "b"] and [r.source_row for r in rows] == [0, 1]
    array = tmp_path / "array.jsonl"
    array.write_text(json.dumps(ROWS))
    assert [r.answer for r in read_prompt_rows(str(array))] == ["7", "20", "b"]


@pytest.mark.parametrize("name, text, message", [
    ("p.jsonl", '{"prompt": "Hi", "answer": "1"}\n\n{"prompt": "Hi", "answer": }\n',
     r"cannot read data file .*p\.jsonl as json: row 1 \(line 3\) is not valid JSON: "
     r"Expecting value at column 28; write one JSON object per line"),
    ("p.json", '[{"prompt": "Hi",\n "answer": "1"},\n]',
     r"cannot read data file .*p\.json as json: line 3 column 1: .*; write one JSON array"),
    ("p.jsonl", '{"prompt": "Hi", "answer": "1"}\n["Hi", "1"]\n',
     r"row 1 of .*p\.jsonl is a JSON list, not an object; write one object per row"),
])
def test_unreadable_json_names_the_row(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_prompt_dataset(str(path), make_tokenizer(), 64)


def test_tokenizer_without_chat_template(tmp_path):
    tok = make_tokenizer(chat_template=None)
    tok.name_or_path = "/models/tiny"
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    with pytest.raises(ValueError, match="tokenizer at /models/tiny has no chat_template; "
                                         "set apply_chat_template false"):
        load_prompt_dataset(path, tok, 64)


def _items(n):
    return [PromptItem(prompt_ids=[i], answer=str(i), prompt_text=str(i), source_row=i)
            for i in range(n)]


def _answers(batch):
    return [int(it.answer) for it in batch]


def test_order_is_deterministic_epoch_shuffled_and_resumable():
    ds = PromptDataset(_items(10), seed=3)
    first = [_answers(ds.next_batch(4)) for _ in range(5)]
    # epoch 0 yields 2 batches of its permutation (the tail of 2 is skipped), then epoch 1
    order_0 = [int(i) for i in PromptDataset(_items(10), seed=3).order(0)]
    assert order_0 != list(range(10)) and sorted(order_0) == list(range(10))
    assert first[0] + first[1] == order_0[:8]
    assert ds.state_dict() == {"epoch": 2, "offset": 4, "seed": 3, "num_prompts": 10}
    assert first[0] + first[1] != first[2] + first[3]  # a new permutation per epoch

    again = PromptDataset(_items(10), seed=3)
    assert [_answers(again.next_batch(4)) for _ in range(5)] == first  # deterministic

    resumed = PromptDataset(_items(10), seed=3)
    probe = PromptDataset(_items(10), seed=3)
    probe.next_batch(4), probe.next_batch(4), probe.next_batch(4)
    resumed.load_state_dict(probe.state_dict())
    assert [_answers(resumed.next_batch(4)) for _ in range(2)] == first[3:]

    batches = PromptDataset(_items(10), seed=3).batches(4)
    assert [_answers(next(batches)) for _ in range(5)] == first


def test_state_mismatch_and_batch_size_errors():
    ds = PromptDataset(_items(10), seed=3)
    with pytest.raises(ValueError, match="for 12 prompts but the dataset has 10"):
        ds.load_state_dict({"epoch": 0, "offset": 0, "seed": 3, "num_prompts": 12})
    with pytest.raises(ValueError, match="seed 4 but megatron_training.seed is 3"):
        ds.load_state_dict({"epoch": 0, "offset": 0, "seed": 4, "num_prompts": 10})
    with pytest.raises(ValueError, match="global_batch_size=11"):
        ds.next_batch(11)


def test_sequential_batches_and_dp_slices():
    ds = PromptDataset(_items(5), shuffle=False)
    assert [_answers(b) for b in ds.sequential_batches(2)] == [[0, 1], [2, 3], [4]]
    assert [_answers(b) for b in ds.sequential_batches(2, num_prompts=3)] == [[0, 1], [2]]
    assert _answers(ds.next_batch(4)) == [0, 1, 2, 3]
    batch = _items(6)
    assert _answers(slice_per_dp_rank(batch, 1, 3)) == [2, 3]
    with pytest.raises(ValueError, match="does not split over 4"):
        slice_per_dp_rank(batch, 0, 4)


def test_arithmetic_problems_deterministic_and_disjoint():
    train, test = make_arithmetic_problems(300, 100, seed=5, max_operand=20, ops="+-*")
    assert (train, test) == make_arithmetic_problems(300, 100, seed=5, max_operand=20, ops="+-*")
    assert train != make_arithmetic_problems(300, 100, seed=6, max_operand=20)[0]
    assert len(train) == 300 and len(test) == 100
    prompts = [r["prompt"] for r in train + test]
    assert len(set(prompts)) == 400  # distinct, so train and test are disjoint
    for row in train + test:
        question = row["prompt"]
        assert question.startswith("What is ") and question.endswith("?")
        expression = question[len("What is "):-1]
        assert str(eval(expression)) == row["answer"]  # noqa: S307 -- our own digits and +-*
        assert int(row["answer"]) >= 0
    train, _ = make_arithmetic_problems(2, 0, seed=1, ops="+",
                                        instruction="Answer with the number.")
    assert train[0]["prompt"].endswith("? Answer with the number.")
    with pytest.raises(ValueError, match="exceed the 4 distinct problems"):
        make_arithmetic_problems(4, 1, seed=0, max_operand=2, ops="+")
    with pytest.raises(ValueError, match="ops='/'"):
        make_arithmetic_problems(1, 1, seed=0, ops="/")


def _load_tool(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_arithmetic_dataset_tool(tmp_path, capsys):
    tool = _load_tool("make_arithmetic_dataset")
    assert tool.main(["--out", str(tmp_path), "--num-train", "8", "--num-test", "4",
                      "--seed", "2", "--max-operand", "9", "--ops", "+-"]) == 0
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (tmp_path / "test.jsonl").read_text().splitlines()]
    assert len(train) == 8 and len(test) == 4
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    ds = load_prompt_dataset(str(tmp_path / "train.jsonl"), make_tokenizer(), 64)
    assert len(ds) == 8


def test_preprocess_tool_round_trip(tmp_path, capsys):
    tok_dir = tmp_path / "tok"
    make_tokenizer().save_pretrained(str(tok_dir))
    source = write_jsonl(tmp_path / "p.jsonl", ROWS)
    out = tmp_path / "p.tokenized.parquet"
    tool = _load_tool("preprocess_data")
    assert tool.main(["--input", source, "--output", str(out), "--tokenizer", str(tok_dir),
                      "--max-prompt-length", "10", "--no-progress"]) == 0
    assert "wrote 1 prompts" in capsys.readouterr().out  # the two questions are 11 tokens
    assert pq.read_schema(out).metadata[b"mindspeed_rl.num_dropped"] == b"2"
    direct = load_prompt_dataset(source, AutoTokenizer.from_pretrained(str(tok_dir)), 10)
    pre = load_prompt_dataset(str(out), None, 10)  # no tokenizer needed
    assert [(it.prompt_ids, it.prompt_text, it.answer) for it in pre] == \
           [(it.prompt_ids, it.prompt_text, it.answer) for it in direct]
    assert pre.num_dropped == 0
    # the length filter also applies to a pre-tokenized file
    out_all = tmp_path / "all.parquet"
    assert tool.main(["--input", source, "--output", str(out_all), "--tokenizer", str(tok_dir),
                      "--no-progress"]) == 0
    assert load_prompt_dataset(str(out_all), None, 10).num_dropped == 2


def test_indexed_dataset_written_by_the_tool_and_read_back(tmp_path, capsys):
    """MindSpeed-RL's packed indexed format: the tool writes it with megatron-core's builder,
    data_path = its prefix reads the same prompts and answers as the raw file."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tok_dir = tmp_path / "tok"
    make_tokenizer().save_pretrained(str(tok_dir))
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    source = write_jsonl(tmp_path / "p.jsonl", ROWS)
    prefix = tmp_path / "packed" / "data"
    tool = _load_tool("preprocess_data")
    assert tool.main(["--input", source, "--output-prefix", str(prefix), "--tokenizer",
                      str(tok_dir), "--no-progress"]) == 0
    assert "wrote 3 prompts" in capsys.readouterr().out
    for field in ("input_ids", "attention_mask", "labels"):
        assert (tmp_path / "packed" / f"data_packed_{field}_document.idx").is_file()
    direct = load_prompt_dataset(source, tok, 64, shuffle=False)
    stored = IndexedDataset(f"{prefix}_packed_input_ids_document")
    assert [stored[i].tolist() for i in range(len(stored))] == [it.prompt_ids for it in direct]
    packed = load_prompt_dataset(str(prefix), tok, 64, shuffle=False)
    assert [(it.prompt_ids, it.answer) for it in packed] == \
           [(it.prompt_ids, it.answer) for it in direct]
    assert [it.answer for it in packed] == ["7", "20", "b"]
    # the length filter applies as to any prompt file
    assert load_prompt_dataset(str(prefix), tok, 10).num_dropped == 2


def test_indexed_dataset_without_labels(tmp_path):
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path / "data"
    builder = IndexedDatasetBuilder(f"{prefix}_packed_input_ids_document.bin", dtype=np.int32)
    builder.add_item(torch.tensor([7, 8, 9]))
    builder.end_document()
    builder.finalize(f"{prefix}_packed_input_ids_document.idx")
    with pytest.raises(FileNotFoundError, match=r"no \['labels'\] field"):
        load_prompt_dataset(str(prefix), make_tokenizer(), 10)
