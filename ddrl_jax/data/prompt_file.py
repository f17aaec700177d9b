"""Evaluation prompt files with categories (PAI-Bench's shape): one prompt per entry, its category and, for
image-to-video, the image whose first frame conditions it.

Accepted layouts (the extension decides):
  .jsonl  one JSON object per line: {"prompt": str, "category": str, "first_frame": path}; "image" or
          "image_path" may name the first frame instead, "category" defaults to "all";
  .json   a list of such objects;
  .csv    a header row with prompt, category and optionally first_frame;
  .txt    one prompt per line (category "all", text-to-video).
A relative image path is taken from the prompt file's folder. Errors are PromptFileError (a ValueError)
naming the file and the line: an entry without a prompt, an image that does not exist, a line that is not
JSON.
"""
import csv
import dataclasses
import json
import os

IMAGE_KEYS = ('first_frame', 'image', 'image_path')
DEFAULT_CATEGORY = 'all'


class PromptFileError(ValueError):
  """A prompt file that cannot be used; the message names the file (and line)."""


@dataclasses.dataclass(frozen=True)
class EvalPrompt:
  prompt: str
  category: str = DEFAULT_CATEGORY
  first_frame: str | None = None     # absolute path of the conditioning image (I2V), or None (T2V)

  @property
  def mode(self):
    return 'i2v' if self.first_frame else 't2v'


def _entry(obj, where, folder):
  if not isinstance(obj, dict):
    raise PromptFileError(f'{where}: expected an object with "prompt", got {type(obj).__name__}')
  prompt = obj.get('prompt')
  if not isinstance(prompt, str) or not prompt.strip():
    raise PromptFileError(f'{where}: no "prompt" (a non-empty string)')
  image = next((obj[k] for k in IMAGE_KEYS if obj.get(k)), None)
  if image is not None:
    image = os.path.normpath(os.path.join(folder, str(image)))
    if not os.path.isfile(image):
      raise PromptFileError(f'{where}: first frame {image} does not exist')
  category = str(obj.get('category') or DEFAULT_CATEGORY)
  return EvalPrompt(prompt=prompt.strip(), category=category, first_frame=image)


def read_prompt_file(path):
  """list[EvalPrompt] of a prompt file (see the module docstring), in file order."""
  if not os.path.isfile(path):
    raise PromptFileError(f'prompt file {path} does not exist')
  folder = os.path.dirname(os.path.abspath(path))
  ext = os.path.splitext(path)[1].lower()
  with open(path, encoding='utf-8') as f:
    text = f.read()
  out = []
  if ext == '.jsonl':
    for i, line in enumerate(text.splitlines(), 1):
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        raise PromptFileError(f'{path}:{i}: not JSON ({e.msg})') from e
      out.append(_entry(obj, f'{path}:{i}', folder))
  elif ext == '.json':
    try:
      items = json.loads(text)
    except json.JSONDecodeError as e:
      raise PromptFileError(f'{path}: not JSON ({e.msg} at line {e.lineno})') from e
    if not isinstance(items, list):
      raise PromptFileError(f'{path}: expected a JSON list of prompt objects')
    out = [_entry(obj, f'{path}[{i}]', folder) for i, obj in enumerate(items)]
  elif ext == '.csv':
    rows = csv.DictReader(text.splitlines())
    if 'prompt' not in (rows.fieldnames or []):
      raise PromptFileError(f'{path}: the header row has no "prompt" column ({rows.fieldnames})')
    out = [_entry(row, f'{path}:{i}', folder) for i, row in enumerate(rows, 2)]
  elif ext == '.txt':
    out = [EvalPrompt(line.strip()) for line in text.splitlines() if line.strip()]
  else:
    raise PromptFileError(f'{path}: unknown prompt file type {ext!r}; known: .jsonl, .json, .csv, .txt')
  if not out:
    raise PromptFileError(f'{path}: no prompts')
  return out
