"""UnifiedReward (ddrl_jax/rewards/unified_reward.py) against a fake OpenAI-compatible server on loopback:
the request it sends (model, temperature 0, one PNG image part of the expected size, the caption in
brackets, the key), the score read from canned replies, NaN for replies without a score, retries on 5xx,
timeouts and dead ports that end in NaN (never a hang) with one warning, a 4xx as one error, and requests
that overlap."""
import ast
import base64
import http.server
import io
import json
import logging
import threading
import time

import numpy as np
import portpicker
import pytest
from PIL import Image

from ddrl_jax.rewards import unified_reward as ur

CAPTION = 'a photo of a red {cat} and a "blue" dog'


class FakeServer:
  """An OpenAI-compatible chat server in a thread. `reply(body, n)` -> (status, text or dict, delay_s) for
  the n-th request (0-based); a dict is sent as JSON, a str as a completion whose content is that str."""

  def __init__(self, reply):
    self.reply, self.requests, self.lock = reply, [], threading.Lock()
    self.in_flight = self.max_in_flight = 0
    self.release = threading.Event()    # ends the delays of handlers still sleeping at close
    outer = self

    class Handler(http.server.BaseHTTPRequestHandler):

      def do_POST(self):  # pylint: disable=invalid-name
        body = json.loads(self.rfile.read(int(self.headers['Content-Length'])))
        with outer.lock:
          n = len(outer.requests)
          outer.requests.append({'path': self.path, 'headers': dict(self.headers), 'body': body})
          outer.in_flight += 1
          outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
        status, content, delay = outer.reply(body, n)
        if delay:
          outer.release.wait(delay)
        with outer.lock:
          outer.in_flight -= 1
        if isinstance(content, str):
          content = {'id': f'c{n}', 'object': 'chat.completion', 'model': body['model'],
                     'choices': [{'index': 0, 'finish_reason': 'stop',
                                  'message': {'role': 'assistant', 'content': content}}]}
        data = json.dumps(content).encode()
        try:
          self.send_response(status)
          self.send_header('Content-Type', 'application/json')
          self.send_header('Content-Length', str(len(data)))
          self.end_headers()
          self.wfile.write(data)
        except OSError:      # the client gave up (a timeout test)
          pass

      def log_message(self, *args):
        pass

    self.httpd = http.server.ThreadingHTTPServer(('127.0.0.1', portpicker.pick_unused_port()), Handler)
    self.httpd.daemon_threads = True
    self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
    self.thread.start()
    self.url = f'http://127.0.0.1:{self.httpd.server_address[1]}/v1'

  def close(self):
    self.release.set()
    self.httpd.shutdown()
    self.httpd.server_close()


@pytest.fixture
def serve():
  servers = []

  def start(reply):
    servers.append(FakeServer(reply))
    return servers[-1]

  yield start
  for server in servers:
    server.close()


def images(m, h=24, w=40, seed=0):
  return np.random.default_rng(seed).integers(0, 256, (m, h, w, 3), dtype=np.uint8)


def canned(*texts):
  """reply() answering the i-th request with texts[i % len(texts)] (status 200, no delay)."""
  return lambda body, n: (200, texts[n % len(texts)], 0)


def decode_image(body):
  parts = body['messages'][0]['content']
  (url,) = [p['image_url']['url'] for p in parts if p['type'] == 'image_url']
  assert url.startswith('data:image/png;base64,')
  raw = base64.b64decode(url.split(',', 1)[1])
  assert raw[:8] == b'\x89PNG\r\n\x1a\n'
  return np.asarray(Image.open(io.BytesIO(raw)))


# ------------------------------------------------------------------------------------------ pure parts
@pytest.mark.parametrize('text,score', [
    ('The image shows a cat.\nFinal Score: 4', 0.8),
    ('Final Score: 3.5', 0.7),
    ('Final Score:5', 1.0),
    ('Final Score: 1.25 (out of 5)', 0.25),
    ('no score here', np.nan),
    ('Final Score: 7', np.nan),       # outside the 1-5 pattern
    ('Final Score: 5.5', np.nan),     # in the pattern but above 5
    ('final score: 4', np.nan),       # case matters, as in the references' pattern
])
def test_score_from_reply(text, score):
  np.testing.assert_allclose(ur.score_from_reply(text), score)


@pytest.mark.parametrize('url', [None, '', 'localhost:30000/v1', 'ftp://host/v1', 'http://'])
def test_input_problems_bad_url_is_one_line(url):
  problems = ur.input_problems({'url': url})
  assert len(problems) == 1 and '\n' not in problems[0] and problems[0].startswith('unified_reward')
  with pytest.raises(ValueError, match='unified_reward'):
    ur.UnifiedReward(url=url)


def test_input_problems_never_contacts_the_server(monkeypatch):
  monkeypatch.delenv('UR_TEST_KEY', raising=False)
  dead = f'http://127.0.0.1:{portpicker.pick_unused_port()}/v1'
  assert ur.input_problems({'url': dead}) == []
  assert ur.input_problems({'url': 'https://judge.example:8443/v1'}) == []
  (problem,) = ur.input_problems({'url': dead, 'api_key_env': 'UR_TEST_KEY'})
  assert 'UR_TEST_KEY' in problem


def test_endpoint():
  assert ur.endpoint('http://h:1/v1') == 'http://h:1/v1/chat/completions'
  assert ur.endpoint('http://h:1/v1/') == 'http://h:1/v1/chat/completions'
  assert ur.endpoint('http://h:1/v1/chat/completions') == 'http://h:1/v1/chat/completions'


def test_bad_samples_are_one_line_errors():
  reward = ur.UnifiedReward(url='http://127.0.0.1:1/v1')
  with pytest.raises(ValueError, match=r'unified_reward needs uint8 images \(M, H, W, 3\)'):
    reward(np.zeros((2, 8, 8, 3), np.float32), ['a', 'b'])
  with pytest.raises(ValueError, match='unified_reward: 1 prompts for 2 samples'):
    reward(images(2), ['a'])
  assert reward(images(0), []).shape == (0,)


# ------------------------------------------------------------------------------------------ server
def test_request_and_scores(serve, monkeypatch):
  monkeypatch.setenv('UR_TEST_KEY', 'secret-key')
  server = serve(canned('The caption matches.\nFinal Score: 4', 'Final Score: 3.5'))
  reward = ur.UnifiedReward(url=server.url, model='UnifiedReward-7b-v1.5', api_key_env='UR_TEST_KEY',
                            max_concurrency=1)
  x = images(2)
  scores = reward(x, [CAPTION, 'second caption'])
  assert scores.dtype == np.float32 and scores.shape == (2,)
  np.testing.assert_allclose(scores, [0.8, 0.7], rtol=1e-6)
  assert len(server.requests) == 2
  for request, caption in zip(server.requests, [CAPTION, 'second caption']):
    body = request['body']
    assert request['path'] == '/v1/chat/completions'
    assert request['headers']['Authorization'] == 'Bearer secret-key'
    assert body['model'] == 'UnifiedReward-7b-v1.5' and body['temperature'] == 0
    assert 'max_tokens' not in body
    (message,) = body['messages']
    assert message['role'] == 'user' and [p['type'] for p in message['content']] == ['image_url', 'text']
    assert decode_image(body).shape == (512, 512, 3)     # flow_grpo's resize
    text = message['content'][1]['text']
    assert text.startswith(ur.IMAGE_TOKEN) and text.endswith(f'[{caption}]')
    assert 'Final Score:' in text and '1 to 5' in text


def test_resize_none_sends_the_image_itself(serve):
  server = serve(canned('Final Score: 2'))
  reward = ur.UnifiedReward(url=server.url, resize=None, image_token='')
  x = images(1, 24, 40)
  np.testing.assert_allclose(reward(x, ['c']), [0.4], rtol=1e-6)
  body = server.requests[0]['body']
  np.testing.assert_array_equal(decode_image(body), x[0])        # PNG is lossless
  assert body['messages'][0]['content'][1]['text'].startswith('You are shown')
  assert 'Authorization' not in server.requests[0]['headers']


def test_reply_without_a_score_is_nan_logged_once(serve, caplog):
  server = serve(canned('Final Score: 4', 'I cannot judge this image, sorry. ' * 5, 'Final Score: 7',
                        {'choices': []}))
  reward = ur.UnifiedReward(url=server.url, max_concurrency=1)
  with caplog.at_level(logging.WARNING, logger=ur.__name__):
    scores = reward(images(4), ['a', 'b', 'c', 'd'])
  np.testing.assert_allclose(scores, [0.8, np.nan, np.nan, np.nan])
  (record,) = caplog.records
  message = record.getMessage()
  assert '3 of 4 replies' in message and '\n' not in message
  assert 'I cannot judge this image' in message
  first = message.split('first: ')[1]
  assert len(ast.literal_eval(first)) <= 80     # the %r of the reply's first 80 characters


def test_5xx_is_retried(serve, caplog):
  server = serve(lambda body, n: (500, {'error': 'busy'}, 0) if n == 0 else (200, 'Final Score: 4', 0))
  reward = ur.UnifiedReward(url=server.url, retries=2, backoff_s=0.01)
  with caplog.at_level(logging.WARNING, logger=ur.__name__):
    np.testing.assert_allclose(reward(images(1), ['a']), [0.8], rtol=1e-6)
  assert len(server.requests) == 2 and not caplog.records


def test_5xx_after_the_retries_is_nan_with_one_warning(serve, caplog):
  server = serve(lambda body, n: (503, {'error': 'overloaded'}, 0))
  reward = ur.UnifiedReward(url=server.url, retries=1, backoff_s=0.01)
  with caplog.at_level(logging.WARNING, logger=ur.__name__):
    scores = reward(images(2), ['a', 'b'])
  assert np.isnan(scores).all() and len(server.requests) == 4
  (record,) = caplog.records
  assert server.url in record.getMessage() and 'HTTP 503' in record.getMessage()


@pytest.mark.parametrize('status', [400, 404])
def test_4xx_is_one_clear_error(serve, status):
  server = serve(lambda body, n: (status, {'error': {'message': 'model "x" not found'}}, 0))
  reward = ur.UnifiedReward(url=server.url, model='x', retries=3, backoff_s=0.01)
  with pytest.raises(ur.ServerError) as info:
    reward(images(3), ['a', 'b', 'c'])
  message = str(info.value)
  assert '\n' not in message and server.url in message and f'HTTP {status}' in message
  assert 'not found' in message
  assert len(server.requests) <= 3          # never retried


def test_server_that_never_answers_is_nan_quickly(serve, caplog):
  server = serve(lambda body, n: (200, 'Final Score: 4', 30))
  reward = ur.UnifiedReward(url=server.url, timeout_s=0.3, retries=1, backoff_s=0.05, max_concurrency=2)
  start = time.monotonic()
  with caplog.at_level(logging.WARNING, logger=ur.__name__):
    scores = reward(images(6), list('abcdef'))
  elapsed = time.monotonic() - start
  assert np.isnan(scores).all()
  # Two requests in flight time out twice (0.3 + 0.05 + 0.3 s); the server is then marked unreachable and
  # the four requests not yet sent are skipped.
  assert elapsed < 3.0, elapsed
  assert len(server.requests) <= 4
  (record,) = caplog.records
  assert server.url in record.getMessage() and '6 of 6' in record.getMessage()
  assert 'timed out' in record.getMessage()


def test_dead_port_is_nan_with_one_warning(caplog):
  url = f'http://127.0.0.1:{portpicker.pick_unused_port()}/v1'
  reward = ur.UnifiedReward(url=url, retries=2, backoff_s=0.01)
  start = time.monotonic()
  with caplog.at_level(logging.WARNING, logger=ur.__name__):
    scores = reward(images(5), list('abcde'))
  assert np.isnan(scores).all() and time.monotonic() - start < 3.0
  (record,) = caplog.records
  assert url in record.getMessage() and 'unreachable' in record.getMessage()


def test_requests_overlap(serve):
  delay, m = 0.3, 8
  server = serve(lambda body, n: (200, 'Final Score: 5', delay))
  reward = ur.UnifiedReward(url=server.url, max_concurrency=m, resize=None)
  start = time.monotonic()
  scores = reward(images(m), [f'c{i}' for i in range(m)])
  elapsed = time.monotonic() - start
  np.testing.assert_allclose(scores, np.ones(m))
  assert elapsed < m * delay / 2, elapsed       # sequential requests would take m * delay = 2.4 s
  assert server.max_in_flight >= m // 2, server.max_in_flight


def test_max_concurrency_bounds_the_requests_in_flight(serve):
  server = serve(lambda body, n: (200, 'Final Score: 5', 0.1))
  reward = ur.UnifiedReward(url=server.url, max_concurrency=2, resize=None)
  np.testing.assert_allclose(reward(images(6), list('abcdef')), np.ones(6))
  assert server.max_in_flight == 2


def test_scores_keep_the_samples_order(serve):
  # Later requests answer first; each caption carries its own score.
  server = serve(lambda body, n: (200, f"Final Score: {body['messages'][0]['content'][1]['text'][-2]}",
                                  0.05 * (4 - int(body['messages'][0]['content'][1]['text'][-2]))))
  reward = ur.UnifiedReward(url=server.url, max_concurrency=4, resize=None)
  np.testing.assert_allclose(reward(images(4), ['1', '2', '3', '4']), [0.2, 0.4, 0.6, 0.8], rtol=1e-6)
