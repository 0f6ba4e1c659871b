"""data.py's batching: the rollout sampler (each global rollout batch repeated once per micro-batch of an iteration,
a fresh shuffle per epoch and seed) and the left-padding collator."""

import pytest
import torch
from torch.utils.data import DataLoader

from hf_ppo.trainer.data import PromptCollator, RolloutRepeatSampler


def global_batches(sampler: RolloutRepeatSampler) -> list[list[int]]:
    """The sampler's indices cut into its runs of `repeat` copies of one global batch; each run checked and
    returned once."""
    indices = list(sampler)
    size = sampler.global_batch_size * sampler.repeat
    assert len(indices) == len(sampler) and len(indices) % size == 0
    batches = []
    for start in range(0, len(indices), size):
        run = indices[start:start + size]
        first = run[:sampler.global_batch_size]
        # The same global batch `repeat` times in a row, in the same order.
        assert run == first * sampler.repeat, run
        batches.append(first)
    return batches


@pytest.mark.parametrize("num_prompts, global_batch, repeat", [(12, 4, 3), (10, 3, 4), (5, 5, 1)])
def test_each_global_batch_repeats_in_a_row_and_each_prompt_comes_once_per_epoch(num_prompts, global_batch, repeat):
    sampler = RolloutRepeatSampler(num_prompts, global_batch, repeat, seed=0)
    batches = global_batches(sampler)
    assert len(batches) == num_prompts // global_batch
    assert len(sampler) == len(batches) * global_batch * repeat
    seen = sum(batches, [])
    assert len(set(seen)) == len(seen)  # no prompt twice in one epoch
    assert set(seen) <= set(range(num_prompts))
    assert len(seen) == num_prompts - num_prompts % global_batch  # only the incomplete last batch is dropped


def test_order_changes_with_the_epoch_and_the_seed_and_is_reproducible():
    def order(seed, epoch):
        sampler = RolloutRepeatSampler(16, 4, 2, seed=seed)
        sampler.set_epoch(epoch)
        return global_batches(sampler)

    assert order(0, 0) == order(0, 0)  # reproducible
    assert order(0, 0) != order(0, 1)  # set_epoch reshuffles
    assert order(0, 0) != order(1, 0)  # so does the seed
    assert sorted(sum(order(0, 1), [])) == list(range(16))
    # An epoch is not just a rotation of the same batches: the prompts are regrouped.
    assert {frozenset(b) for b in order(0, 0)} != {frozenset(b) for b in order(0, 1)}


def test_dataloader_gives_each_rollout_batch_once_per_micro_batch():
    """As Trainer builds it (one process): batch_size = the rollout batch; repeat = micro-batches per iteration."""
    prompts = [{"prompt": f"p{i}", "input_ids": list(range(1, i % 3 + 2))} for i in range(8)]
    sampler = RolloutRepeatSampler(len(prompts), global_batch_size=4, repeat=3, seed=5)
    loader = DataLoader(prompts, batch_size=4, sampler=sampler, collate_fn=PromptCollator(pad_token_id=0))
    batches = [b["prompts"] for b in loader]
    assert len(batches) == 6
    assert batches[0] == batches[1] == batches[2] and batches[3] == batches[4] == batches[5]
    assert sorted(batches[0] + batches[3]) == sorted(p["prompt"] for p in prompts)


def test_collator_left_pads_and_masks():
    features = [{"prompt": "a", "input_ids": [5, 6, 7]}, {"prompt": [{"role": "user", "content": "b"}],
                                                           "input_ids": [8]}]
    out = PromptCollator(pad_token_id=0)(features)
    assert out["queries"].tolist() == [[5, 6, 7], [0, 0, 8]] and out["queries"].dtype == torch.long
    assert out["query_mask"].tolist() == [[True, True, True], [False, False, True]]
    assert out["query_mask"].dtype == torch.bool
    assert out["prompts"] == ["a", [{"role": "user", "content": "b"}]]  # raw prompts (text or chat), in order


def test_refill_prompts_are_whole_groups_fixed_by_seed_step_round_and_process():
    from types import SimpleNamespace

    from hf_ppo.trainer.data import RefillPrompts

    dataset = [{"input_ids": list(range(1, 2 + i % 3)), "prompt": f"p{i}"} for i in range(20)]
    args = SimpleNamespace(seed=0, process_index=0, num_generations=2, rollout_batch_size=8)

    def drawn(step=5, round_=0, **changes):
        return RefillPrompts(dataset, PromptCollator(pad_token_id=0), SimpleNamespace(**{**vars(args), **changes}),
                             step)(round_)

    batch = drawn()
    prompts = batch["prompts"]
    assert len(prompts) == 8 and prompts[::2] == prompts[1::2] and len(set(prompts)) == 4  # 4 groups of k=2
    assert batch["queries"].shape == (8, 3) and torch.equal(batch["query_mask"], batch["queries"] != 0)
    assert drawn()["prompts"] == prompts  # the same draw on a resumed run
    others = [drawn(step=6), drawn(round_=1), drawn(seed=1), drawn(process_index=1)]
    assert all(other["prompts"] != prompts for other in others)


# ---- prompt_column and system_prompt (PPOConfig fields: the Python API and the command read prompts alike) ----------
def test_prompt_column_names_the_prompts_and_leaves_competing_prompt_columns_out(tok):
    from datasets import Dataset

    from hf_ppo.trainer.data import prepare_prompts

    data = Dataset.from_dict({"question": ["the movie was", "the food was"], "prompt": ["x", "y"],
                              "answer": ["1", "2"]})
    out = prepare_prompts(data, tok, "train_dataset", max_prompt_length=None, response_length=4, context=None,
                          prompt_column="question")
    assert out["prompt"] == ["the movie was", "the food was"] and out["answer"] == ["1", "2"]
    assert "question" not in out.column_names
    with pytest.raises(ValueError, match=r"no column 'query'.*\['question', 'prompt', 'answer'\].*prompt_column"):
        prepare_prompts(data, tok, "train_dataset", max_prompt_length=None, response_length=4, context=None,
                        prompt_column="query")


def test_system_prompt_leads_every_prompt_text_or_chat(tok):
    from datasets import Dataset

    from hf_ppo.trainer.data import prepare_prompts

    system = {"role": "system", "content": "Answer as #### <number>."}
    kwargs = dict(max_prompt_length=None, response_length=4, context=None, system_prompt=system["content"])
    text = prepare_prompts(Dataset.from_dict({"prompt": ["1+1?"]}), tok, "train_dataset", **kwargs)
    assert text[0]["prompt"] == [system, {"role": "user", "content": "1+1?"}]
    assert "Answer as ####" in tok.decode(text[0]["input_ids"])
    chat = prepare_prompts(Dataset.from_dict({"messages": [[{"role": "user", "content": "2+2?"}]]}), tok,
                           "train_dataset", **kwargs)
    assert chat[0]["prompt"][0] == system
    with pytest.raises(ValueError, match="already opens with a system message"):
        prepare_prompts(Dataset.from_dict({"messages": [[system, {"role": "user", "content": "hi"}]]}), tok,
                        "train_dataset", **kwargs)
    with pytest.raises(ValueError, match="system_prompt needs text or chat prompts"):
        prepare_prompts(Dataset.from_dict({"input_ids": [[5, 6, 7]]}), tok, "train_dataset", **kwargs)


# ---- a chat prompt that ends with an assistant turn (a prefill) is continued, as TRL does -------------------------
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template", ["tiny", "chatml"])
@pytest.mark.parametrize("prefill", ["The answer is", ""])
def test_a_final_assistant_turn_is_continued_not_closed(template, prefill):
    """A prompt ending with an assistant turn ("The answer is", or an empty one) is rendered as TRL renders it
    (`continue_final_message=True`, no generation prompt): the policy continues that turn. It was closed with the
    end-of-turn token and a new assistant turn opened after it, so the policy answered after its own prefill."""
    from datasets import Dataset

    from hf_ppo.cli.tiny import build_tokenizer
    from hf_ppo.trainer.data import prepare_prompts

    tok = build_tokenizer() if template == "tiny" else build_tokenizer(chat_template=CHATML)
    opens, closes = ("<|assistant|>", tok.eos_token) if template == "tiny" else ("<|im_start|>assistant", "<|im_end|>")
    messages = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": prefill}]
    plain = [{"role": "user", "content": "What is 2 + 2?"}]
    data = Dataset.from_dict({"messages": [messages, plain]})
    out = prepare_prompts(data, tok, "train_dataset", max_prompt_length=None, response_length=4, context=None)
    continued, opened = (tok.decode(ids) for ids in out["input_ids"])
    assert out["input_ids"][0] == tok.apply_chat_template(messages, continue_final_message=True,
                                                          add_generation_prompt=False, tokenize=True,
                                                          return_dict=False)
    separator = " " if template == "tiny" else "\n"  # what each template puts between the role and the content
    assert continued.count(opens) == 1 and continued.rstrip().endswith((opens + separator + prefill).strip())
    assert continued.count(closes) == 1  # the user's turn only: the prefill's turn stays open
    assert opened.count(opens) == 1 and opened.rstrip().endswith(opens)  # without a prefill: a new turn, as before
    assert out["prompt"][0] == messages  # the reward functions get the prompt as the dataset gives it


def test_a_missing_prompt_column_stops_the_trainer_before_any_model_loads(tmp_path, monkeypatch):
    """A wrong column was found after the models had loaded (tens of seconds on a real model)."""
    from datasets import Dataset

    from hf_ppo import PPOConfig, PPOLMTrainer
    from hf_ppo.trainer import assembly

    monkeypatch.setattr(assembly, "load_models", lambda *a, **k: pytest.fail("a model loaded"))
    args = PPOConfig(output_dir=str(tmp_path), report_to=[], prompt_column="question")
    with pytest.raises(ValueError, match=r"train_dataset has no column 'question'; its columns are \['text'\]"):
        PPOLMTrainer(model="any/model", args=args, reward_model=lambda p, c: [0.0] * len(c),
                     train_dataset=Dataset.from_dict({"text": ["a"]}))
    with pytest.raises(ValueError, match=r"eval_dataset needs a 'prompt' column.*it has \['text'\]"):
        PPOLMTrainer(model="any/model", args=PPOConfig(output_dir=str(tmp_path), report_to=[]),
                     reward_model=lambda p, c: [0.0] * len(c), eval_dataset=Dataset.from_dict({"text": ["a"]}))


def test_the_collator_reuses_its_batch_only_for_the_very_same_rows():
    collate = PromptCollator(pad_token_id=0)
    rows = [{"input_ids": [5, 6], "prompt": "a b"}, {"input_ids": [7], "prompt": "c"}]
    first = collate(rows)
    assert collate(rows) is first  # the same list object again: the batch already made
    rows[1] = {"input_ids": [8], "prompt": "d"}  # the same list, a row replaced in place: collated anew
    assert collate(rows)["queries"].tolist() == [[5, 6], [0, 8]]
    again = collate([dict(r) for r in rows])  # equal rows read anew: collated anew, with the same values
    assert again is not first and again["queries"].tolist() == [[5, 6], [0, 8]]


def test_the_training_dataloader_reads_each_rollout_batch_once_per_iteration(tmp_path, tiny_models, tokenizer):
    """Trainer's DataLoader asks for one iteration's batch once per micro-batch (4 here); the dataset is read once per
    iteration, and every micro-batch still carries that iteration's prompts, in order."""
    from datasets import Dataset

    from hf_ppo import PPOConfig, PPOLMTrainer

    reads = []

    class Counting(torch.utils.data.Dataset):
        def __init__(self, dataset):
            self.dataset = dataset

        def __len__(self):
            return len(self.dataset)

        def __getitem__(self, i):
            reads.append(i)
            return self.dataset[i]

    prompts = [f"the movie number {i} was" for i in range(12)]
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_mini_batches=2, num_ppo_epochs=2,
                     response_length=4, max_steps=8, use_cpu=True, report_to="none", save_strategy="no",
                     reward_quantization="none", ref_quantization="none")
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                           reward_model=lambda p, c: [0.0] * len(c), train_dataset=Dataset.from_dict({"prompt": prompts}))
    trainer.train_dataset = Counting(trainer.train_dataset)
    loader = trainer.get_train_dataloader()
    steps = args.optimizer_steps_per_iteration * args.gradient_accumulation_steps
    assert steps == 4
    batches = [batch["prompts"] for batch, _ in zip(loader, range(3 * steps))]
    for iteration in range(3):
        run = batches[iteration * steps:(iteration + 1) * steps]
        assert all(b == run[0] for b in run) and len(run[0]) == args.rollout_batch_size
    assert batches[0] != batches[steps] != batches[2 * steps]
    assert len(reads) == 3 * args.rollout_batch_size  # once per iteration: without the memory, 4 times as many
