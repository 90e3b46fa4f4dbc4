// The program every sandboxed Node.js process runs (infra/node_runtime/process.py starts it).
//
// argv[2] is the customer code's file. It is loaded once; then each line read on stdin is one
// invocation {"id": n, "payload": ...}; the exported async function is called with the payload and
// one line is written on stdout per invocation:
//   {"id": n, "ok": true, "value": <what the function returned, JSON>}
//   {"id": n, "ok": false, "error": {"name", "message", "errors", "marked"}}
// The first line written is {"ready": true}, or {"load_error": {"kind", "name", "message"}} when the
// code does not load or does not export a function (the process then exits).
// An error carrying Symbol.for('tessera.error') (the classes of a module the platform ships) is
// "marked": its message and errors are the code's answer to the caller. Of any other thrown value
// only the name is passed on, since its message may quote the data the code was given.
// The customer's console output goes to stderr, never into the protocol.
'use strict';

const { Console } = require('node:console');

const MARK = Symbol.for('tessera.error');
const write = process.stdout.write.bind(process.stdout);
const quiet = new Console({ stdout: process.stderr, stderr: process.stderr });
globalThis.console = quiet;

function send(message) {
  let line;
  try {
    line = JSON.stringify(message);
  } catch (err) {
    line = JSON.stringify({
      id: message.id,
      ok: false,
      error: { name: 'TypeError', message: `the result is not JSON: ${err.message}`, marked: false, result: true },
    });
  }
  write(line + '\n');
}

function describe(err) {
  if (err !== null && typeof err === 'object' && err[MARK] === true) {
    return { name: String(err.name), message: String(err.message), errors: err.errors ?? null, marked: true };
  }
  const name = err !== null && typeof err === 'object' && typeof err.name === 'string' ? err.name : typeof err;
  return { name, message: null, errors: null, marked: false };
}

let handler;
try {
  const exported = require(process.argv[2]);
  handler = typeof exported === 'function' ? exported
    : exported !== null && typeof exported === 'object' && typeof exported.default === 'function' ? exported.default
      : null;
  if (handler === null) {
    send({ load_error: { kind: 'not_a_function', name: typeof exported, message: 'the module does not export a function' } });
    process.exit(3);
  }
} catch (err) {
  const kind = err instanceof SyntaxError ? 'syntax' : 'load';
  send({ load_error: { kind, name: err && err.name ? String(err.name) : typeof err, message: err && err.message ? String(err.message) : '' } });
  process.exit(3);
}

async function run(id, payload) {
  try {
    const value = await handler(payload);
    send({ id, ok: true, value: value === undefined ? null : value });
  } catch (err) {
    send({ id, ok: false, error: describe(err) });
  }
}

let buffered = '';
process.stdin.setEncoding('utf8');
process.stdin.on('data', (chunk) => {
  buffered += chunk;
  let end;
  while ((end = buffered.indexOf('\n')) >= 0) {
    const line = buffered.slice(0, end);
    buffered = buffered.slice(end + 1);
    const frame = JSON.parse(line);
    run(frame.id, frame.payload);
  }
});
process.stdin.on('end', () => process.exit(0));
send({ ready: true });
