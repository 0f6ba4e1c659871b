"""The architecture matrix: tiny random models of the families people train, with tokenizers shaped like theirs.

Each model is built from its real config class (hidden <= 64, 2 layers), saved, and given to the trainer by path, so it
goes through the real `from_pretrained`. Each tokenizer is trained locally with `tokenizers` and carries the family's
special tokens, pad situation, chat template and stop tokens (Llama 3: no pad, `<|finetune_right_pad_id|>`, several
stop ids; Qwen: pad == a stop token, `<|fim_pad|>`; GPT-2: no unused special token at all...). For every architecture
PPO trains one iteration with step-0 KL exactly 0 and a first ratio exactly 1, and the saved policy reloads and
generates.
"""

import math
import warnings
from dataclasses import dataclass, field

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.cli.tiny import synthetic_reviews
from tests.devices import on_device_of

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


@dataclass
class Arch:
    """One row of the matrix: how to build the model and its tokenizer, and what the trainer must make of them."""

    name: str
    config: callable  # (vocab_size, tokenizer) -> config
    specials: list  # special tokens, in id order from 0
    roles: dict  # bos/eos/unk/pad -> token
    template: str | None = None
    generation_eos: list = field(default_factory=list)  # extra stop tokens of generation_config.eos_token_id
    extra_rows: int = 0  # embedding rows beyond the tokenizer (vocabularies padded to a multiple of 64...)
    expected_pad: str | None = None  # the pad the trainer must use
    user_pad: str | None = None  # a pad the user adds (fits a spare embedding row; no resize)


def _llama(vocab, tok):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=128, attention_dropout=0.1,
                       tie_word_embeddings=False)


def _qwen2(vocab, tok):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       attention_dropout=0.1, tie_word_embeddings=True)


def _qwen3(vocab, tok):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                       attention_dropout=0.1, tie_word_embeddings=True)


def _mistral(vocab, tok):
    from transformers import MistralConfig

    return MistralConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attention_dropout=0.1, sliding_window=None)


def _gemma2(vocab, tok):
    from transformers import Gemma2Config

    return Gemma2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                        sliding_window=16, attention_dropout=0.1)


def _gemma3_text_kwargs(vocab):
    return dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=128, sliding_window=16,
                attention_dropout=0.1)


def _gemma3_text(vocab, tok):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**_gemma3_text_kwargs(vocab))


def _gemma3_multimodal(vocab, tok):
    from transformers import Gemma3Config

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, attention_dropout=0.1)
    return Gemma3Config(text_config=_gemma3_text_kwargs(vocab), vision_config=vision, mm_tokens_per_image=4,
                        image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),
                        boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
                        eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"))


def _phi3(vocab, tok):
    from transformers import Phi3Config

    return Phi3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                      resid_pdrop=0.1, embd_pdrop=0.1, attention_dropout=0.1, pad_token_id=None,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)


def _gpt2(vocab, tok):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.1,
                      embd_pdrop=0.1, attn_pdrop=0.1, summary_first_dropout=0.1, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)


def _gpt_neox(vocab, tok):
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=128, attention_dropout=0.1,
                         hidden_dropout=0.1, tie_word_embeddings=False)


def _opt(proj):
    def build(vocab, tok):
        from transformers import OPTConfig

        hidden = 64 if proj else 32
        return OPTConfig(vocab_size=vocab, hidden_size=hidden, word_embed_proj_dim=32, ffn_dim=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=128, do_layer_norm_before=not proj,
                         dropout=0.1, attention_dropout=0.1, layerdrop=0.1 if not proj else 0.0,
                         pad_token_id=1, bos_token_id=2, eos_token_id=2)
    return build


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                 "<|fim_pad|>", "<|vision_start|>", "<|image_pad|>"]
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                  "<end_of_image>", "<image_soft_token>", "<unused0>"]
GEMMA_ROLES = {"bos": "<bos>", "eos": "<eos>", "unk": "<unk>", "pad": "<pad>"}
ARCHS = [
    Arch("llama3", _llama,
         ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
          "<|finetune_right_pad_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"],
         {"bos": "<|begin_of_text|>", "eos": "<|end_of_text|>"}, LLAMA3_TEMPLATE,
         generation_eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], expected_pad="<|finetune_right_pad_id|>"),
    Arch("qwen2", _qwen2, QWEN_SPECIALS, {"eos": "<|endoftext|>", "pad": "<|endoftext|>"}, CHATML_TEMPLATE,
         generation_eos=["<|endoftext|>"], extra_rows=20, expected_pad="<|fim_pad|>"),
    Arch("qwen3", _qwen3, QWEN_SPECIALS, {"eos": "<|im_end|>", "pad": "<|endoftext|>"}, CHATML_TEMPLATE,
         generation_eos=["<|im_end|>", "<|endoftext|>"], extra_rows=20, expected_pad="<|fim_pad|>"),
    Arch("mistral", _mistral, ["<unk>", "<s>", "</s>"], {"bos": "<s>", "eos": "</s>", "unk": "<unk>"},
         MISTRAL_TEMPLATE, expected_pad="<unk>"),
    Arch("gemma2", _gemma2, GEMMA_SPECIALS[:7], GEMMA_ROLES, GEMMA_TEMPLATE, generation_eos=["<eos>", "<end_of_turn>"],
         expected_pad="<pad>"),
    Arch("gemma3_text", _gemma3_text, GEMMA_SPECIALS, GEMMA_ROLES, GEMMA_TEMPLATE,
         generation_eos=["<eos>", "<end_of_turn>"], expected_pad="<pad>"),
    Arch("gemma3_multimodal", _gemma3_multimodal, GEMMA_SPECIALS, GEMMA_ROLES, GEMMA_TEMPLATE,
         generation_eos=["<eos>", "<end_of_turn>"], expected_pad="<pad>"),
    Arch("phi3", _phi3,
         ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|system|>", "<|end|>",
          "<|user|>"],
         {"bos": "<s>", "eos": "<|endoftext|>", "unk": "<unk>", "pad": "<|endoftext|>"}, PHI3_TEMPLATE,
         generation_eos=["<|endoftext|>", "<|end|>"], expected_pad="<|placeholder1|>"),
    Arch("gpt2", _gpt2, ["<|endoftext|>"], {"bos": "<|endoftext|>", "eos": "<|endoftext|>", "unk": "<|endoftext|>"},
         extra_rows=8, user_pad="[PAD]", expected_pad="[PAD]"),
    Arch("gpt_neox", _gpt_neox, ["<|endoftext|>", "<|padding|>"],
         {"bos": "<|endoftext|>", "eos": "<|endoftext|>", "unk": "<|endoftext|>"}, extra_rows=30,
         expected_pad="<|padding|>"),
    Arch("opt125m", _opt(proj=False), ["<s>", "<pad>", "</s>", "<unk>"],
         {"bos": "</s>", "eos": "</s>", "unk": "<unk>", "pad": "<pad>"}, extra_rows=7, expected_pad="<pad>"),
    Arch("opt350m", _opt(proj=True), ["<s>", "<pad>", "</s>", "<unk>"],
         {"bos": "</s>", "eos": "</s>", "unk": "<unk>", "pad": "<pad>"}, extra_rows=7, expected_pad="<pad>"),
]
BY_NAME = {a.name: a for a in ARCHS}
QLORA = ["llama3", "qwen3", "opt350m"]


def build_tokenizer(arch: Arch) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with `arch`'s special tokens at ids 0.. (trained on the synthetic reviews)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=arch.roles.get("unk")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=arch.specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(synthetic_reviews(300), trainer=trainer)
    roles = {f"{role}_token": token for role, token in arch.roles.items()}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=128, **roles)
    if arch.template:
        fast.chat_template = arch.template
    return fast


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small run faster on one thread than on two (no OpenMP barriers per tiny matmul)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def saved_arch(tmp_path_factory):
    """arch name -> folder with the tiny model and its tokenizer (built once per session, on first use)."""
    folders = {}

    def get(name: str) -> str:
        if name not in folders:
            arch = BY_NAME[name]
            tok = build_tokenizer(arch)
            config = arch.config(len(tok) + arch.extra_rows, tok)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
            ids = [tok.convert_tokens_to_ids(t) for t in arch.generation_eos]
            model.generation_config.eos_token_id = ids if len(ids) > 1 else (ids[0] if ids else tok.eos_token_id)
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder)
            tok.save_pretrained(folder)
            folders[name] = str(folder)
        return folders[name]

    return get


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


def arch_args(tmp_path, **overrides) -> PPOConfig:
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=1,
                    num_mini_batches=1, num_ppo_epochs=1, max_steps=1, response_length=4, logging_steps=1,
                    learning_rate=1e-2, report_to=[], save_strategy="no", num_sample_generations=0,
                    disable_tqdm=True, seed=0, temperature=1.0)
    defaults.update(overrides)
    return PPOConfig(**defaults)


def arch_dataset(tok) -> Dataset:
    if tok.chat_template:
        return Dataset.from_dict({"messages": [[{"role": "user", "content": "the movie was"}],
                                               [{"role": "user", "content": "the food"}]]})
    return Dataset.from_dict({"prompt": ["the movie was", "the food"]})


def user_tokenizer(arch: Arch, folder: str):
    tok = AutoTokenizer.from_pretrained(folder)
    if arch.user_pad:
        tok.add_special_tokens({"pad_token": arch.user_pad})
    return tok


MATRIX = [(a.name, "full") for a in ARCHS] + [(a.name, "lora") for a in ARCHS] + [(n, "qlora") for n in QLORA]


@pytest.mark.parametrize("name, mode", MATRIX, ids=[f"{n}-{m}" for n, m in MATRIX])
def test_architecture_trains_with_zero_step0_kl_and_reloads(saved_arch, tmp_path, name, mode):
    from peft import LoraConfig

    arch, folder = BY_NAME[name], saved_arch(name)
    tok = user_tokenizer(arch, folder)
    peft_config = None if mode == "full" else LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                         target_modules="all-linear", task_type="CAUSAL_LM")
    args = arch_args(tmp_path, policy_quantization="4bit" if mode == "qlora" else "none")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = PPOLMTrainer(model=folder, args=args, processing_class=tok, reward_model=count_e,
                               train_dataset=arch_dataset(tok), peft_config=peft_config)
    used = trainer.processing_class
    assert used.pad_token == arch.expected_pad
    announced = [w for w in record if "padding with" in str(w.message)]
    assert len(announced) == (0 if arch.roles.get("pad") == arch.expected_pad or arch.user_pad else 1)
    stops = {tok.convert_tokens_to_ids(t) for t in arch.generation_eos} | {tok.eos_token_id}
    assert set(trainer.stop_token_ids) == stops and used.pad_token_id not in stops
    body = trainer.model.pretrained_model
    assert trainer.model.v_head.in_features == body.get_output_embeddings().in_features
    if mode != "full":
        lora_names = [n for n, _ in body.named_modules() if n.endswith("lora_A")]
        assert lora_names and not [n for n in lora_names if "vision" in n]  # all-linear: language model only

    trainer.train()

    first = trainer.state.log_history[0]
    assert first["objective/kl"] == 0.0, first["objective/kl"]  # policy == reference at step 0, bit for bit
    assert first["policy/approxkl_avg"] == 0.0 and first["val/ratio"] == 1.0, first

    out = tmp_path / "saved"
    trainer.save_model(str(out))
    reloaded_tok = AutoTokenizer.from_pretrained(out)
    assert reloaded_tok.pad_token == arch.expected_pad
    if mode == "full":
        reloaded = AutoModelForCausalLM.from_pretrained(out)
    else:
        from peft import PeftModel

        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), out)
    reloaded.eval()
    prompt = reloaded_tok(["the movie was", "a"], return_tensors="pt", padding=True)
    generated = reloaded.generate(**prompt, max_new_tokens=3, do_sample=False, pad_token_id=reloaded_tok.pad_token_id,
                                  eos_token_id=trainer.stop_token_ids)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    if mode == "full":  # the saved weights are the trained ones
        body.eval()
        with torch.no_grad():  # the reloaded model on the CPU, the run's on its device
            trained = body(**{k: on_device_of(body, v) for k, v in prompt.items()}).logits.cpu()
            torch.testing.assert_close(reloaded(**prompt).logits, trained)


def test_no_unused_special_token_fails_with_the_fix_for_an_id(saved_arch, tmp_path):
    """GPT-2's tokenizer has only `<|endoftext|>` (BOS = EOS = UNK): nothing to pad with, so the trainer refuses,
    and the fix works as written (the embedding has spare rows: a new special token needs no resize)."""
    folder = saved_arch("gpt2")
    tok = AutoTokenizer.from_pretrained(folder)
    with pytest.raises(ValueError, match=r"has no pad token.*add_special_tokens\(\{'pad_token'"):
        PPOLMTrainer(model=folder, args=arch_args(tmp_path), processing_class=tok, reward_model=count_e,
                     train_dataset=arch_dataset(tok))


def test_no_spare_row_fails_with_the_resize_fix_for_an_object(tmp_path):
    arch = BY_NAME["gpt2"]
    tok = build_tokenizer(arch)
    model = AutoModelForCausalLM.from_config(arch.config(len(tok), tok))
    with pytest.raises(ValueError, match=r"resize_token_embeddings\(len\(tokenizer\)\).*adapter"):
        PPOLMTrainer(model=model, args=arch_args(tmp_path), processing_class=tok, reward_model=count_e,
                     train_dataset=arch_dataset(tok))


def test_added_pad_without_resize_blames_the_policy(saved_arch, tmp_path):
    folder = saved_arch("mistral")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"pad_token": "[PAD]"})  # Mistral's embedding has no spare row
    with pytest.raises(ValueError, match=r"policy's embedding has only .*resize_token_embeddings"):
        PPOLMTrainer(model=folder, args=arch_args(tmp_path), processing_class=tok, reward_model=count_e,
                     train_dataset=arch_dataset(tok))


def test_reference_with_a_smaller_vocabulary_is_refused(saved_arch, tmp_path):
    folder = saved_arch("qwen3")
    tok = AutoTokenizer.from_pretrained(folder)
    small = AutoModelForCausalLM.from_config(_mistral(100, tok))
    with pytest.raises(ValueError, match=r"reference model's embedding has only 100 rows"):
        PPOLMTrainer(model=folder, ref_model=small, args=arch_args(tmp_path), processing_class=tok,
                     reward_model=count_e, train_dataset=arch_dataset(tok))


def test_policy_quantization_with_a_model_object_is_refused(saved_arch, tmp_path):
    from peft import LoraConfig

    folder = saved_arch("llama3")
    with pytest.raises(ValueError, match=r"policy_quantization='4bit' applies only.*BitsAndBytesConfig"):
        PPOLMTrainer(model=AutoModelForCausalLM.from_pretrained(folder), processing_class=AutoTokenizer.from_pretrained(folder),
                     args=arch_args(tmp_path, policy_quantization="4bit"), reward_model=count_e,
                     train_dataset=arch_dataset(AutoTokenizer.from_pretrained(folder)),
                     peft_config=LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))


def test_stop_token_id_and_stop_token_none(saved_arch, tmp_path):
    folder = saved_arch("llama3")
    tok = AutoTokenizer.from_pretrained(folder)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    build = lambda **kw: PPOLMTrainer(model=folder, args=arch_args(tmp_path, **kw), processing_class=tok,  # noqa: E731
                                      reward_model=count_e, train_dataset=arch_dataset(tok))
    assert build(stop_token_id=eot).stop_token_ids == [eot]
    assert build(stop_token=None).stop_token_ids == []
    assert build(stop_token_ids=[eot, 7]).stop_token_ids == [eot, 7]
    with pytest.raises(ValueError, match="outside the policy's vocabulary"):
        build(stop_token_ids=[10_000])

    from hf_ppo.models.tokenizers import check_stop_token_ids

    with pytest.raises(ValueError, match="no stop token"):  # e.g. a tokenizer without EOS and the EOS trick on
        check_stop_token_ids([], AutoModelForCausalLM.from_pretrained(folder), needs_stop=True)


def test_all_linear_lora_skips_the_vision_tower_unless_named(saved_arch):
    from peft import LoraConfig, get_peft_model

    from hf_ppo.models.policy import language_model_lora_config

    model = AutoModelForCausalLM.from_pretrained(saved_arch("gemma3_multimodal"))
    config = LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")
    resolved = language_model_lora_config(model, config)
    assert config.target_modules == "all-linear"  # the user's config is not modified
    names = [n for n, _ in get_peft_model(model, resolved).named_modules() if n.endswith("lora_A")]
    assert any("language_model" in n for n in names) and not any("vision_tower" in n for n in names)
    named = LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    assert language_model_lora_config(model, named) is named  # explicit names are kept: they may name the tower


def test_disable_dropout_reaches_float_attributes_and_sub_configs(saved_arch):
    """OPT applies dropout from float attributes (and layerdrop); Gemma 3's vision tower reads its sub-config."""
    from hf_ppo.models.pretrained import disable_dropout

    for name in ("opt125m", "gemma3_multimodal"):
        model = AutoModelForCausalLM.from_pretrained(saved_arch(name))
        disable_dropout(model)
        floats = [(n, k) for n, m in model.named_modules() for k, v in vars(m).items()
                  if ("dropout" in k or "layerdrop" in k) and isinstance(v, float) and v != 0]
        assert not floats
        configs = [model.config, *(getattr(model.config, k) for k in ("text_config", "vision_config")
                                   if hasattr(model.config, k))]
        assert all(v == 0 for c in configs for k, v in vars(c).items() if "dropout" in k and isinstance(v, float))
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        with torch.no_grad():
            train_logits = model.train()(input_ids=ids).logits
            torch.testing.assert_close(train_logits, model.eval()(input_ids=ids).logits, rtol=0, atol=0)


def test_same_tokenizer_ignores_the_pad_id(saved_arch):
    from hf_ppo.models.tokenizers import same_tokenizer

    a = AutoTokenizer.from_pretrained(saved_arch("qwen3"))
    b = AutoTokenizer.from_pretrained(saved_arch("qwen3"))
    b.pad_token = "<|fim_pad|>"
    assert same_tokenizer(a, b)
    assert not same_tokenizer(a, AutoTokenizer.from_pretrained(saved_arch("llama3")))


CRITIC_ARCHS = ["gpt2", "gpt_neox", "opt350m", "qwen3", "gemma3_text", "phi3", "mistral"]


@pytest.mark.parametrize("name", CRITIC_ARCHS)
def test_separate_critic_on_each_architecture(saved_arch, tmp_path, name):
    # A critic with its own body, started from the architecture's own checkpoint (loaded as a sequence classifier):
    # its values come from the backbone's last hidden state, whatever width the architecture gives it.
    from peft import LoraConfig

    arch, folder = BY_NAME[name], saved_arch(name)
    tok = user_tokenizer(arch, folder)
    def one_plus_e(prompts, completions):  # never all zero, so the value loss has something to fit
        return [1.0 + c.count("e") for c in completions]

    trainer = PPOLMTrainer(model=folder, args=arch_args(tmp_path, critic="separate"), processing_class=tok,
                           reward_model=one_plus_e, critic_model=folder, train_dataset=arch_dataset(tok),
                           peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    critic_before = {n: p.detach().clone() for n, p in trainer.model.critic.named_parameters() if p.requires_grad}
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["objective/kl"] == 0.0 and first["val/ratio"] == 1.0, first
    assert math.isfinite(first["loss/value_avg"])
    now = dict(trainer.model.critic.named_parameters())
    assert any(not torch.equal(critic_before[n], now[n]) for n in critic_before), "the critic did not train"
