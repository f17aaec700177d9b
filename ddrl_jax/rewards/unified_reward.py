"""UnifiedReward (CodeGoat24/UnifiedReward-7b-v1.5) as an image reward, judged by a model behind an
OpenAI-compatible HTTP server.

What it computes (flow_grpo / DiffusionNFT `unifiedreward_score_sglang` in flow_grpo/rewards.py; cosmos-rl's
reward service, model/unified_reward.py):
  server   the model served with an OpenAI-compatible chat API: sglang
           (`python -m sglang.launch_server --model-path CodeGoat24/UnifiedReward-7b-v1.5
           --chat-template chatml-llava --port 30000 [--api-key KEY]`) or vLLM; `url` is its base URL
           (http://host:30000/v1); requests go to <url>/chat/completions.
  request  one chat completion per image, temperature 0, `model` = the served name ('UnifiedReward-7b-v1.5'):
           one user message of two content parts, the image first (an `image_url` part holding a
           data:image/png;base64 URL of the image, resized to resize x resize first, bicubic, as
           flow_grpo's PIL resize((512, 512)) does; cosmos-rl sends it at its own size: resize=None), then
           the text IMAGE_TOKEN + INSTRUCTION with the caption in brackets.
  score    the first match of SCORE_PATTERN, `Final Score:\\s*([1-5](?:\\.\\d+)?)`, in the reply, / 5: in
           [0.2, 1.0]. The pattern is the references' and reads 'Final Score: 10' as 1 (0.2); a matched
           value above 5 ('5.5') is a failure here.

The instruction: INSTRUCTION has the references' structure (the judge is told it sees an image generated
from a caption; asked to assess (1) its alignment with the caption and (2) its overall quality; asked for
a score from 1 to 5 after "Final Score:"; the caption follows in brackets) in this project's own words. The
references' exact wording was not copied and this text may differ from it; the judge's replies, and so the
scores' distribution, can depend on the wording, so scores are not interchangeable with the references'
until checked against a served model. IMAGE_TOKEN ('<image>\\n') precedes it in the text as in flow_grpo
(how each server treats it beside the image part it inserts for the image_url was not checked here: that
needs a served model); image_token='' sends the instruction alone. The data URL names its type
(data:image/png;base64,..., the standard form; flow_grpo's says data:image;base64,...).

Failures (a deliberate difference from the references, which score an unparsable reply 0, a valid-looking
score that poisons the group's advantages): a sample that cannot be scored is NaN, which the reward
service counts as a failure, never a score.
  no score in the reply      NaN; one warning per call with the count and the first reply's first 80 chars.
  5xx, 408, 429, connection  retried `retries` times with exponential backoff (backoff_s, 2 backoff_s, ...);
  errors and timeouts        then NaN, with one warning per call naming the URL. A request that exhausts its
                             retries on a connection error or a timeout marks the server unreachable for
                             the rest of the call: requests not yet sent are NaN at once, so a dead or hung
                             server costs at most about (retries + 1) timeout_s plus the backoffs per call,
                             never a hang (timeout_s bounds each socket wait, not a reply's total time).
  other 4xx                  `ServerError`, one line naming the URL, the status and the server's message (a
                             wrong model name or a malformed request is a configuration error, not data).
Environment proxies are not used (the judge runs on the cluster's own network).

Only the standard library (urllib.request, json, base64, concurrent.futures) plus numpy and PIL.
"""
import base64
import concurrent.futures
import http.client
import io
import json
import logging
import math
import os
import re
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request

import numpy as np

from ddrl_jax.rewards import video_common

logger = logging.getLogger(__name__)

NAME = 'unified_reward'
DEFAULT_MODEL = 'UnifiedReward-7b-v1.5'
RESIZE = 512                 # flow_grpo's resize((512, 512)); None sends the image as it is (cosmos-rl)
IMAGE_TOKEN = '<image>\n'    # flow_grpo's text starts with it
# This project's wording of the references' instruction (see the module docstring); {caption} is replaced.
INSTRUCTION = (
    'You are shown an image that was generated from a text caption. Judge the image on two criteria:\n'
    '1. Caption alignment: how faithfully the image shows what the caption describes, including the '
    'objects it names, their attributes and how they relate to each other.\n'
    '2. Overall image quality: how good the image looks, including its sharpness, detail, colours and '
    'overall aesthetic appeal.\n'
    "Weighing both criteria, give the image a score from 1 to 5 after 'Final Score:'.\n"
    'The caption is:\n'
    '[{caption}]')
SCORE_PATTERN = re.compile(r'Final Score:\s*([1-5](?:\.\d+)?)')
MAX_SCORE = 5.0
RETRY_STATUS = (408, 429)    # 4xx statuses that are transient (besides every 5xx)


class ServerError(RuntimeError):
  """The server refused a request (a 4xx other than 408 / 429); the message is one line naming the URL."""


class _Unreachable(Exception):
  """A request that exhausted its retries on connection errors or timeouts."""


class _Failed(Exception):
  """A request that exhausted its retries on 5xx / 408 / 429 answers."""


# ------------------------------------------------------------------------------------------ inputs
def url_problems(url):
  """One-line problems with `url` (the server's base URL), found without contacting it."""
  if not url:
    return [f'{NAME}: config.reward.kwargs.{NAME}.url is not set (the base URL of an OpenAI-compatible '
            f'server of {DEFAULT_MODEL}, e.g. http://host:30000/v1)']
  parts = urllib.parse.urlsplit(str(url))
  if parts.scheme not in ('http', 'https') or not parts.netloc:
    return [f'{NAME}: url {url!r} is not an http(s) URL (give the server\'s base URL, e.g. '
            f'http://host:30000/v1)']
  return []


def input_problems(kwargs):
  """One-line problems with UnifiedReward(**kwargs)'s url and key (the trainer's preflight); the server is
  not contacted."""
  problems = url_problems(kwargs.get('url'))
  env = kwargs.get('api_key_env')
  if env and not os.environ.get(env):
    problems.append(f'{NAME}: api_key_env={env!r} names an environment variable that is not set')
  return problems


def endpoint(url):
  """The chat completions URL of a base URL (a URL already ending in /chat/completions is kept)."""
  url = str(url).rstrip('/')
  return url if url.endswith('/chat/completions') else url + '/chat/completions'


def check_images(samples, prompts):
  """`samples` as an array after checking it is (M, H, W, 3) uint8 with M prompts."""
  samples = np.asarray(samples)
  if samples.dtype != np.uint8 or samples.ndim != 4 or samples.shape[-1] != 3:
    raise ValueError(f'{NAME} needs uint8 images (M, H, W, 3), got {samples.dtype} {samples.shape}')
  if len(prompts) != samples.shape[0]:
    raise ValueError(f'{NAME}: {len(prompts)} prompts for {samples.shape[0]} samples')
  return samples


# ------------------------------------------------------------------------------------------ request
def image_data_url(image, resize=RESIZE):
  """(H, W, 3) uint8 -> 'data:image/png;base64,...', resized to resize x resize first (PIL's bicubic,
  the default of its resize) unless resize is None or 0. PNG is lossless at any level: zlib level 1 takes
  a quarter of the default's time for the same pixels."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  picture = Image.fromarray(np.ascontiguousarray(image))
  if resize:
    picture = picture.resize((int(resize), int(resize)), Image.BICUBIC)
  buffer = io.BytesIO()
  picture.save(buffer, format='PNG', compress_level=1)
  return 'data:image/png;base64,' + base64.b64encode(buffer.getvalue()).decode('ascii')


def request_body(data_url, caption, model=DEFAULT_MODEL, image_token=IMAGE_TOKEN, max_tokens=None):
  """The chat completion request (a JSON-able dict) judging one image (a data URL) against `caption`."""
  text = image_token + INSTRUCTION.replace('{caption}', caption)
  body = {'model': model, 'temperature': 0,
          'messages': [{'role': 'user', 'content': [
              {'type': 'image_url', 'image_url': {'url': data_url}},
              {'type': 'text', 'text': text}]}]}
  if max_tokens:
    body['max_tokens'] = int(max_tokens)
  return body


def reply_text(payload):
  """The assistant's text in a chat completion response (the decoded JSON); ValueError if it has none."""
  try:
    content = payload['choices'][0]['message']['content']
  except (KeyError, IndexError, TypeError) as e:
    raise ValueError(f'no choices[0].message.content in the response ({type(e).__name__})') from e
  if not isinstance(content, str):
    raise ValueError(f'choices[0].message.content is {type(content).__name__}, not text')
  return content


def score_from_reply(text):
  """The reply's score / 5 in [0.2, 1]: the first 'Final Score: <1-5[.digits]>' in it; NaN when there is
  none or the number exceeds 5 (the references score 0 there)."""
  match = SCORE_PATTERN.search(text)
  if not match:
    return math.nan
  value = float(match.group(1))
  return value / MAX_SCORE if value <= MAX_SCORE else math.nan


def _describe(e):
  if isinstance(e, urllib.error.HTTPError):
    return f'HTTP {e.code} {e.reason}'
  if isinstance(e, urllib.error.URLError):
    e = e.reason if isinstance(e.reason, BaseException) else e
  if isinstance(e, (socket.timeout, TimeoutError)):
    return 'timed out'
  return f'{type(e).__name__}: {str(e).strip()[:120]}' if str(e).strip() else type(e).__name__


def _http_error_message(url, e):
  try:
    detail = e.read().decode('utf-8', 'replace')
  except Exception:  # pylint: disable=broad-except  (the message is best effort)
    detail = ''
  detail = ' '.join(detail.split())[:200]
  return (f'{NAME}: the server at {url} refused the request: HTTP {e.code} {e.reason}'
          + (f': {detail}' if detail else '') + ' (check url, model and api_key_env)')


class UnifiedReward:
  """reward(samples, prompts) -> (M,) float32 UnifiedReward scores in [0.2, 1] of (M, H, W, 3) uint8
  images (NaN: not scored), one chat completion per image.

  Args:
    url: the server's base URL, e.g. http://host:30000/v1 (see the module docstring).
    model: the served model name sent in each request.
    api_key_env: the name of an environment variable holding the server's API key (sent as a Bearer token);
      None sends no key.
    timeout_s: the per-request socket timeout (connecting, and each wait for the reply's bytes).
    retries: how many times a request is retried after a connection error, a timeout or a 5xx / 408 / 429.
    resize: the images' side before encoding (flow_grpo: 512); None or 0 sends them at their own size
      (cosmos-rl).
    max_concurrency: requests in flight at once (threads).
    backoff_s: the wait before the first retry, doubled before each next one.
    image_token: text before the instruction (flow_grpo's '<image>\\n'); '' for none.
    max_tokens: the reply's token limit sent to the server; None sends none (the references).
  """

  def __init__(self, url=None, model=DEFAULT_MODEL, api_key_env=None, timeout_s=120.0, retries=2,
               resize=RESIZE, max_concurrency=16, backoff_s=1.0, image_token=IMAGE_TOKEN, max_tokens=None):
    problems = input_problems({'url': url, 'api_key_env': api_key_env})
    if problems:
      raise ValueError(problems[0])
    if float(timeout_s) <= 0 or int(retries) < 0 or int(max_concurrency) < 1 or float(backoff_s) < 0:
      raise ValueError(f'{NAME}: timeout_s {timeout_s} and backoff_s {backoff_s} must be > 0 and >= 0, '
                       f'retries {retries} >= 0 and max_concurrency {max_concurrency} >= 1')
    self.url, self.endpoint, self.model = str(url), endpoint(url), str(model)
    self.timeout_s, self.retries, self.backoff_s = float(timeout_s), int(retries), float(backoff_s)
    self.resize = int(resize) if resize else None
    self.max_concurrency, self.image_token, self.max_tokens = int(max_concurrency), image_token, max_tokens
    self.headers = {'Content-Type': 'application/json'}
    if api_key_env:
      self.headers['Authorization'] = f'Bearer {os.environ[api_key_env]}'
    self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # no environment proxies

  def post(self, body):
    """The response's text to one request; raises urllib / socket / http.client errors."""
    request = urllib.request.Request(self.endpoint, data=json.dumps(body).encode('utf-8'),
                                     headers=self.headers, method='POST')
    with self.opener.open(request, timeout=self.timeout_s) as response:
      return response.read().decode('utf-8', 'replace')

  def _post_with_retries(self, body, stop):
    """The response's text to `body`, retried on transient failures. Raises ServerError on a 4xx, and
    after the retries _Unreachable (connection errors, timeouts; `stop` is set) or _Failed (5xx)."""
    for attempt in range(self.retries + 1):
      try:
        return self.post(body)
      except urllib.error.HTTPError as e:
        if 400 <= e.code < 500 and e.code not in RETRY_STATUS:
          raise ServerError(_http_error_message(self.url, e)) from None
        error, unreachable = e, False
      except (urllib.error.URLError, http.client.HTTPException, OSError) as e:   # OSError: timeouts, resets
        error, unreachable = e, True
      if attempt == self.retries or stop.wait(self.backoff_s * 2 ** attempt):
        break
    if unreachable:
      stop.set()                    # requests not yet sent are skipped
      raise _Unreachable(_describe(error))
    raise _Failed(_describe(error))

  def judge(self, image, caption, stop):
    """(score, what went wrong or None, the reply) for one (H, W, 3) image; score NaN when not scored.
    Raises ServerError (a 4xx) and _Unreachable; returns NaN at once when `stop` is set."""
    if stop.is_set():
      return math.nan, 'skipped', None
    body = request_body(image_data_url(image, self.resize), caption, self.model, self.image_token,
                        self.max_tokens)
    try:
      raw = self._post_with_retries(body, stop)
    except _Failed as e:
      return math.nan, f'failed: {e}', None
    try:
      text = reply_text(json.loads(raw))
    except ValueError as e:        # not JSON, or no text in it
      return math.nan, 'unparsed', f'{raw[:80]} ({video_common.first_line(e)})'
    score = score_from_reply(text)
    return score, ('unparsed' if math.isnan(score) else None), text

  def __call__(self, samples, prompts):
    samples = check_images(samples, prompts)
    out = np.full((samples.shape[0],), np.nan, np.float32)
    if not samples.shape[0]:
      return out
    stop = threading.Event()        # set when the server is unreachable or refused a request
    problems = {'unparsed': [], 'failed': [], 'unreachable': [], 'skipped': []}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(self.max_concurrency, samples.shape[0]),
                                                 thread_name_prefix=NAME)
    try:
      futures = {pool.submit(self.judge, image, prompt, stop): i
                 for i, (image, prompt) in enumerate(zip(samples, prompts))}
      for future in concurrent.futures.as_completed(futures):
        i = futures[future]
        try:
          score, problem, detail = future.result()
        except _Unreachable as e:
          stop.set()
          problems['unreachable'].append(str(e))
          continue
        except ServerError:
          stop.set()
          raise
        out[i] = score
        if problem == 'unparsed':
          problems['unparsed'].append(detail)
        elif problem:
          problems[problem.split(':')[0]].append(problem)
    finally:
      pool.shutdown(wait=False, cancel_futures=True)
    self._warn(problems, samples.shape[0])
    return out

  def _warn(self, problems, total):
    """At most one warning line per kind of failure in a call."""
    if problems['unparsed']:
      first = ' '.join(problems['unparsed'][0].split())[:80]
      logger.warning('%s: %d of %d replies have no "Final Score: <1-5>" (scored NaN); first: %r', NAME,
                     len(problems['unparsed']), total, first)
    down = len(problems['unreachable']) + len(problems['skipped'])
    if down:
      logger.warning('%s: the server at %s is unreachable after %d retries (%s): %d of %d samples scored '
                     'NaN', NAME, self.url, self.retries, problems['unreachable'][0], down, total)
    if problems['failed']:
      logger.warning('%s: the server at %s failed %d of %d requests after %d retries (%s): scored NaN', NAME,
                     self.url, len(problems['failed']), total, self.retries,
                     problems['failed'][0][len('failed: '):])
