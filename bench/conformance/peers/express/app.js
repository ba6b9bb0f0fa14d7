// The counting service (bench/conformance/README.md) as an Express app, its executions wrapped by
// express-idempotency with the package's defaults (in-memory data adapter), mounted on POST and PATCH
// as the package's README mounts it on POST. The address to listen on is the first argument
// (127.0.0.1:PORT).
'use strict';

const express = require('express');
const { idempotency, getSharedIdempotencyService } = require('express-idempotency');

const [host, port] = (process.argv[2] || '127.0.0.1:3000').split(':');
const counts = new Map();

function intParam(query, name, fallback) {
  const value = query[name];
  if (typeof value !== 'string' || !/^\d+$/.test(value)) return fallback;
  return Number(value);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

const app = express();
app.disable('x-powered-by');
app.disable('etag');

// The whole body as text, whatever its type, so the middleware's intent check compares it.
const text = express.text({ type: () => true, limit: '64mb' });

const keyed = idempotency();
const service = getSharedIdempotencyService();

// An execution: counted first (the body parser and the middleware, which need the body, ran before).
async function execute(req, res) {
  // A request the middleware answered (a stored response) or refused (in progress) is not executed.
  if (service.isHit(req)) return;
  const n = (counts.get(req.path) || 0) + 1;
  counts.set(req.path, n);
  const received = typeof req.body === 'string' ? req.body : '';
  const q = req.query;
  const failFirst = intParam(q, 'fail_first', 0);
  const status = n <= failFirst ? intParam(q, 'fail_status', 503) : intParam(q, 'status', 201);
  const delay = intParam(q, 'delay_ms', 0);
  if (delay > 0) await sleep(delay);
  const doc = { execution: n, method: req.method, path: req.path, received };
  const size = intParam(q, 'size', null);
  if (size !== null) {
    doc.pad = '';
    const short = size - Buffer.byteLength(JSON.stringify(doc));
    if (short > 0) doc.pad = 'x'.repeat(short);
  }
  const body = JSON.stringify(doc);
  res.status(status);
  // setHeader, not res.set: Express would add "; charset=utf-8".
  res.setHeader('Content-Type', 'application/json');
  res.setHeader('X-Execution', String(n));
  const chunks = intParam(q, 'chunks', 0);
  if (chunks === 0) {
    res.send(Buffer.from(body));
    return;
  }
  const bytes = Buffer.from(body);
  const pieces = Math.max(1, Math.min(chunks, bytes.length));
  const gap = intParam(q, 'chunk_ms', 0);
  for (let i = 0; i < pieces; i++) {
    if (i > 0 && gap > 0) await sleep(gap);
    res.write(bytes.subarray(Math.floor((i * bytes.length) / pieces), Math.floor(((i + 1) * bytes.length) / pieces)));
  }
  res.end();
}

app.get('/count/*', (req, res) => {
  const rest = req.path.slice('/count/'.length);
  res.json({ count: counts.get('/c/' + rest) || 0 });
});
app.post('/c/*', text, keyed, execute);
app.patch('/c/*', text, keyed, execute);
app.all('/c/*', text, execute);
app.all('*', (req, res) => res.status(404).json({ error: 'not found' }));

app.listen(Number(port), host, () => {
  console.log(`express-idempotency counting service on http://${host}:${port}`);
});
