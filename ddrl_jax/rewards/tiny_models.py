"""Shared pieces of the tiny random checkpoints the torch video rewards write for smoke runs and tests.

Each reward module has its own `save_tiny(folder, seed=0) -> kwargs` (videoalign, vbench, cosmos_reason1):
it writes random weights in that reward's real checkpoint layout, so the reward's real loading code runs,
and returns the keyword arguments that build the reward on them:

    kwargs = videoalign.save_tiny('/tmp/tiny_videoalign')
    reward = rewards.make_reward('videoalign', **kwargs)

This module holds what the two Qwen-VL checkpoints share: a small byte-level BPE tokenizer with Qwen's
special tokens and a Qwen-VL-style chat template. Nothing here imports torch, transformers or tokenizers
at module import; the builders import them when called.
"""
import contextlib

QWEN_TOKENS = ('<|endoftext|>', '<|im_start|>', '<|im_end|>', '<|vision_start|>', '<|vision_end|>',
               '<|image_pad|>', '<|video_pad|>')
# Qwen-VL's chat format in brief: string or list content, video markers (for {'type': 'video'} items and
# qwen_vl_utils-style {'video': ...} items), a default system turn, the generation prompt.
QWEN_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if loop.first and m.role != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif -%}"
    "{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.content is string -%}{{ m.content }}{%- else -%}{%- for c in m.content -%}"
    "{%- if c.type == 'video' or 'video' in c -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in c -%}{{ c.text }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")
TINY_VOCAB = 600          # the tokenizer's size (special tokens included)
TINY_MODEL_VOCAB = 640    # the tiny models' embedding rows (room for added tokens)


def qwen_tokenizer(corpus, vocab_size=TINY_VOCAB, chat_template=None):
  """A transformers fast tokenizer: byte-level BPE trained on `corpus` (a list of strings) to vocab_size
  tokens, Qwen's special tokens (eos <|im_end|>, pad <|endoftext|>) and `chat_template` (None: none)."""
  import transformers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders  # pylint: disable=g-import-not-at-top
  from tokenizers import models  # pylint: disable=g-import-not-at-top
  from tokenizers import pre_tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
  from tokenizers import trainers  # pylint: disable=g-import-not-at-top
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(QWEN_TOKENS), show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(list(corpus), trainer=trainer)
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, eos_token='<|im_end|>', pad_token='<|endoftext|>',
      additional_special_tokens=list(QWEN_TOKENS[1:]), chat_template=chat_template)


def qwen_token_ids(tokenizer):
  """{'image_token_id', 'video_token_id', 'vision_start_token_id', 'vision_end_token_id'} of a tokenizer
  from `qwen_tokenizer`, as a Qwen-VL config names them."""
  ids = dict(zip(QWEN_TOKENS, tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS))))
  return dict(image_token_id=ids['<|image_pad|>'], video_token_id=ids['<|video_pad|>'],
              vision_start_token_id=ids['<|vision_start|>'], vision_end_token_id=ids['<|vision_end|>'])


def tiny_text_config():
  """The language model of both tiny Qwen-VLs: 2 layers of width 64, 4 query and 2 key/value heads of 16,
  mRoPE sections (2, 3, 3) (half the head dim), tied embeddings."""
  return dict(vocab_size=TINY_MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
              rope_scaling={'type': 'mrope', 'mrope_section': [2, 3, 3]}, tie_word_embeddings=True)


@contextlib.contextmanager
def seeded(seed):
  """torch's global CPU generator seeded with `seed` inside the block and restored after it (module
  initialisers draw from the global generator)."""
  import torch  # pylint: disable=g-import-not-at-top
  with torch.random.fork_rng(devices=[]):
    torch.manual_seed(seed)
    yield
