// berth's web UI: plain modules, no build step. Every page reads the HTTP
// API through blocking queries (`?index=N&wait=D`), so a page changes as
// the cluster does without polling faster than the blocking wait.

const main = document.getElementById('main');
const conn = document.getElementById('conn');
const TOKEN_KEY = 'berth.token';
const WAIT = '60s';

// ---- DOM ------------------------------------------------------------------

/** An element: `attrs` sets attributes (`on*` functions become listeners),
 * children are nodes, strings (as text, never HTML), arrays or nothing. */
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith('on') && typeof v === 'function') el.addEventListener(k.slice(2), v);
    else if (k === 'class') el.className = v;
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

const link = (href, ...children) => h('a', { href }, ...children);

/** An ID shortened to 8 characters, the full ID on hover, and a button
 * that copies it. */
function shortId(id, href) {
  if (!id) return h('span', { class: 'muted' }, '—');
  const text = h('span', { class: 'id', title: id }, id.length > 8 ? id.slice(0, 8) : id);
  const copy = h('button', {
    type: 'button', class: 'copy', title: 'Copy the full ID', 'aria-label': `Copy ${id}`,
    onclick: (e) => {
      e.preventDefault();
      navigator.clipboard?.writeText(id).then(() => flash(copy, '✓'), () => flash(copy, '✗'));
    },
  }, 'copy');
  return h('span', { class: 'id' }, href ? h('a', { href }, text) : text, copy);
}

function flash(el, text) {
  const old = el.textContent;
  el.textContent = text;
  setTimeout(() => { el.textContent = old; }, 1200);
}

/** "3m ago" (or "in 2m"), the exact time on hover; kept fresh by tick(). */
function ago(ms) {
  if (!ms) return h('span', { class: 'muted' }, '—');
  return h('time', { datetime: new Date(ms).toISOString(), title: new Date(ms).toLocaleString(), 'data-ms': ms }, relative(ms));
}

function relative(ms) {
  const d = Math.round((Date.now() - ms) / 1000);
  const a = Math.abs(d);
  const text = a < 5 ? 'just now' : a < 60 ? `${a}s` : a < 3600 ? `${Math.floor(a / 60)}m`
    : a < 86400 ? `${Math.floor(a / 3600)}h${Math.floor((a % 3600) / 60) ? ` ${Math.floor((a % 3600) / 60)}m` : ''}`
      : `${Math.floor(a / 86400)}d`;
  if (a < 5) return text;
  return d >= 0 ? `${text} ago` : `in ${text}`;
}

setInterval(() => {
  for (const t of document.querySelectorAll('time[data-ms]')) t.textContent = relative(Number(t.dataset.ms));
}, 10000);

function status(word, extra) {
  const w = String(word ?? 'unknown');
  return h('span', { class: `status s-${w.replace(/[^a-z-]/gi, '')} ${extra || ''}` }, w);
}

function table(headers, rows, empty) {
  if (!rows.length) return h('p', { class: 'muted' }, empty || 'None.');
  return h('div', { class: 'table-wrap' }, h('table', {},
    h('thead', {}, h('tr', {}, headers.map((x) => (typeof x === 'string'
      ? h('th', { scope: 'col' }, x) : h('th', { scope: 'col', class: x.class }, x.text))))),
    h('tbody', {}, rows.map((r) => h('tr', {}, r.map((c) => (c && c.td ? h('td', { class: c.class }, c.td) : h('td', {}, c))))))));
}

const num = (v) => ({ td: v === undefined || v === null ? '—' : String(v), class: 'num' });

function facts(pairs) {
  return h('dl', { class: 'facts' }, pairs.filter(Boolean).map(([k, v]) => [h('dt', {}, k), h('dd', {}, v ?? '—')]));
}

function bytes(n) {
  if (n === null || n === undefined) return '—';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  let v = Number(n);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${v < 10 && i ? v.toFixed(1) : Math.round(v)} ${units[i]}`;
}

const plural = (n, one, many) => `${n} ${n === 1 ? one : (many || `${one}s`)}`;
const enc = encodeURIComponent;

// ---- the API ----------------------------------------------------------------

export class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

function token() { return sessionStorage.getItem(TOKEN_KEY) || ''; }

/** A request to the agent's API; an answer that is not 2xx throws an
 * ApiError carrying the API's own message. */
export async function api(path, { method = 'GET', body, signal } = {}) {
  const headers = {};
  if (token()) headers['X-Berth-Token'] = token();
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  let resp;
  try {
    resp = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body), signal });
  } catch (e) {
    if (e.name === 'AbortError') throw e;
    throw new ApiError(0, 'the agent cannot be reached');
  }
  if (!resp.ok) {
    let message = resp.statusText;
    try { message = (await resp.json()).error || message; } catch { /* not JSON */ }
    throw new ApiError(resp.status, message);
  }
  return resp;
}

async function getJson(path, signal) { return (await api(path, { signal })).json(); }

/** Shows whether the agent answers. */
function online(ok, why) {
  conn.className = ok ? 'conn' : 'conn down';
  conn.textContent = ok ? '' : `Agent unreachable: ${why}. Retrying…`;
}

/** Follows `path` with blocking queries while the page lives: `onData`
 * gets each answer whose index moved; errors go to `onError`. */
function follow(page, path, onData, onError) {
  const sep = path.includes('?') ? '&' : '?';
  (async () => {
    let index = 0;
    let backoff = 500;
    while (!page.signal.aborted) {
      const started = Date.now();
      try {
        const url = index ? `${path}${sep}index=${index}&wait=${WAIT}` : path;
        const resp = await api(url, { signal: page.signal });
        const next = Number(resp.headers.get('x-berth-index')) || 0;
        const data = await resp.json();
        online(true);
        backoff = 500;
        if (!index || next !== index) onData(data);
        // An index that went back (a restarted or new leader) starts over.
        index = next < index ? 0 : next;
        // An answer that did not block (no index) waits a little.
        if (!next && Date.now() - started < 1000) await sleep(2000, page.signal);
      } catch (e) {
        if (page.signal.aborted) return;
        if (e.status === 0 || e.status >= 500) online(false, e.message);
        else online(true);
        if (onError) onError(e);
        if (e.status === 401 || e.status === 403) askToken(e.message);
        await sleep(backoff, page.signal);
        backoff = Math.min(backoff * 2, 10000);
      }
    }
  })();
}

function sleep(ms, signal) {
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms);
    signal?.addEventListener('abort', () => { clearTimeout(t); resolve(); }, { once: true });
  });
}

// ---- the token ----------------------------------------------------------------

const tokenDialog = document.getElementById('token');
const tokenInput = document.getElementById('token-secret');
let self = null; // the token's own record, when ACLs are on

function askToken(why) {
  if (tokenDialog.open) return;
  document.getElementById('token-why').textContent = why
    ? `${why}. Give a token; it is kept in this tab's session storage only.`
    : 'The token is kept in this tab\'s session storage only.';
  document.getElementById('token-who').textContent = self ? `Now: ${self.name || self.accessor_id} (${self.type})` : '';
  tokenInput.value = '';
  tokenDialog.showModal();
}

tokenDialog.addEventListener('close', async () => {
  if (tokenDialog.returnValue === 'save' && tokenInput.value.trim()) {
    sessionStorage.setItem(TOKEN_KEY, tokenInput.value.trim());
  } else if (tokenDialog.returnValue === 'clear') {
    sessionStorage.removeItem(TOKEN_KEY);
  } else {
    return;
  }
  await whoAmI();
  route();
});
document.getElementById('token-button').addEventListener('click', () => askToken(''));

/** What the token may do: with ACLs off, everything. */
async function whoAmI() {
  self = null;
  if (!token()) return;
  try {
    self = await getJson('/v1/acl/token/self');
  } catch (e) {
    self = null;
  }
}

// ---- confirmation -----------------------------------------------------------------

const confirmDialog = document.getElementById('confirm');

/** Asks before an action; resolves true when confirmed. */
function confirmed(title, text, ok) {
  document.getElementById('confirm-title').textContent = title;
  document.getElementById('confirm-text').textContent = text;
  document.getElementById('confirm-ok').textContent = ok;
  confirmDialog.returnValue = '';
  confirmDialog.showModal();
  return new Promise((resolve) => {
    confirmDialog.addEventListener('close', () => resolve(confirmDialog.returnValue === 'ok'), { once: true });
  });
}

/** A button that runs `act` after confirmation, showing what came of it. */
function action(label, title, text, act, danger = true) {
  const b = h('button', {
    type: 'button', class: danger ? 'danger' : '',
    onclick: async () => {
      if (!(await confirmed(title, text, label))) return;
      b.disabled = true;
      try {
        await act();
        notice(`${label}: done.`);
      } catch (e) {
        notice(`${label} failed: ${e.message}`, true);
      } finally {
        b.disabled = false;
      }
    },
  }, label);
  return b;
}

function notice(text, bad) {
  const old = document.getElementById('notice');
  if (old) old.remove();
  main.prepend(h('p', { id: 'notice', class: bad ? 'banner' : 'banner info', role: 'status' }, text));
}

// ---- pages --------------------------------------------------------------------

/** A page's parts: each region re-renders alone when its data moves. */
function region(name) {
  return h('section', { 'data-region': name, 'aria-live': 'off' }, h('p', { class: 'muted' }, 'Loading…'));
}

function fill(el, ...children) {
  el.replaceChildren();
  append(el, children);
}

function failure(el, e) {
  if (e.status === 0 || e.status >= 500) return; // the header says so
  fill(el, h('p', { class: 'banner' }, e.message));
}

function groupCounts(g) {
  const parts = [];
  for (const k of ['queued', 'starting', 'running', 'failed', 'complete', 'lost', 'unknown']) {
    if (g[k]) parts.push(h('span', { class: `s-${k}` }, `${g[k]} ${k}`));
  }
  return parts.length ? parts.flatMap((p, i) => (i ? [', ', p] : [p])) : h('span', { class: 'muted' }, 'no allocs');
}

function jobsPage(page) {
  const filter = h('input', { class: 'filter', type: 'search', placeholder: 'Filter by ID prefix', 'aria-label': 'Filter jobs by ID prefix' });
  const list = region('jobs');
  let jobs = [];
  const render = () => {
    const p = filter.value.trim();
    const rows = jobs.filter((j) => !p || j.id.startsWith(p)).map((j) => [
      link(`#/jobs/${enc(j.id)}`, j.id), j.type, num(j.priority), status(j.stop ? 'stopped' : j.status),
      h('span', {}, (j.task_groups || []).map((g, i) => [i ? h('br') : null, `${g.name}: `,
        j.summary && j.summary[g.name] ? groupCounts(j.summary[g.name]) : `${g.count} wanted`])),
      ago(j.modify_time_ms),
    ]);
    fill(list, table(['ID', 'Type', { text: 'Priority', class: 'num' }, 'Status', 'Groups', 'Submitted'], rows,
      p ? `No job starts with "${p}".` : 'No jobs yet: berth job run FILE submits one.'));
  };
  filter.addEventListener('input', render);
  follow(page, '/v1/jobs', (data) => { jobs = data; render(); }, (e) => failure(list, e));
  return [h('h1', {}, 'Jobs'), filter, list];
}

function jobPage(page, id) {
  const head = region('job');
  const summary = region('summary');
  const allocs = region('allocs');
  const versions = region('versions');
  const refresh = async () => {
    try {
      const s = await getJson(`/v1/job/${enc(id)}/summary`, page.signal);
      fill(summary, table(['Group', { text: 'Queued', class: 'num' }, { text: 'Starting', class: 'num' },
        { text: 'Running', class: 'num' }, { text: 'Failed', class: 'num' }, { text: 'Complete', class: 'num' },
        { text: 'Lost', class: 'num' }, { text: 'Unknown', class: 'num' }],
      Object.entries(s.groups).map(([g, c]) => [g, num(c.queued), num(c.starting), num(c.running), num(c.failed),
        num(c.complete), num(c.lost), num(c.unknown)])));
    } catch (e) { if (!page.signal.aborted) failure(summary, e); }
  };
  follow(page, `/v1/job/${enc(id)}`, async (job) => {
    fill(head,
      h('div', { class: 'actions' }, !job.stop && can('submit-job')
        ? action('Stop job', `Stop job ${job.id}?`, `Every alloc of ${job.id} is stopped. The job stays, marked stopped; job run starts it again.`,
          () => api(`/v1/job/${enc(job.id)}`, { method: 'DELETE' }))
        : null),
      facts([
        ['Status', status(job.stop ? 'stopped' : job.status)],
        ['Type', job.type], ['Priority', job.priority], ['Version', job.version],
        ['Datacenters', (job.datacenters || []).join(', ')],
        ['Submitted', ago(job.modify_time_ms)],
      ]),
      job.placement_failures && job.placement_failures.length
        ? [h('h2', {}, 'Placement failures'), h('ul', {}, job.placement_failures.map((f) => h('li', { class: 's-failed' }, f)))]
        : null);
    try {
      const vs = await getJson(`/v1/job/${enc(id)}/versions`, page.signal);
      fill(versions, table(['Version', 'Stable', 'Submitted', 'Changes'], vs.map((v) => [
        num(v.version), v.stable ? 'yes' : 'no', ago(v.submit_time_ms),
        v.diff && v.diff.length ? plural(v.diff.length, 'change') : '—'])));
    } catch (e) { if (!page.signal.aborted) failure(versions, e); }
  }, (e) => failure(head, e));
  follow(page, `/v1/job/${enc(id)}/allocations`, (list) => {
    list.sort((a, b) => b.create_index - a.create_index);
    fill(allocs, allocTable(list, { node: true }));
    refresh();
  }, (e) => failure(allocs, e));
  return [h('h1', {}, `Job ${id}`), head, h('h2', {}, 'Groups'), summary, h('h2', {}, 'Allocations'), allocs,
    h('h2', {}, 'Versions'), versions];
}

function allocTable(list, { node, job }) {
  return table(['ID', job ? 'Job' : null, 'Name', node ? 'Node' : null, 'Version', 'Desired', 'Status', 'Created', 'Modified'].filter(Boolean),
    list.map((a) => [
      shortId(a.id, `#/allocs/${enc(a.id)}`),
      job ? link(`#/jobs/${enc(a.job_id)}`, a.job_id) : null,
      a.name,
      node ? shortId(a.node_id, `#/nodes/${enc(a.node_id)}`) : null,
      num(a.job ? a.job.version : undefined),
      status(a.desired_status),
      status(a.client_status),
      ago(a.create_time_ms), ago(a.modify_time_ms),
    ].filter((c) => c !== null)), 'No allocations.');
}

function allocPage(page, id) {
  const head = region('alloc');
  const tasks = region('tasks');
  const volumes = region('volumes');
  const logs = h('section', { 'data-region': 'logs' });
  let logTasks = null;
  follow(page, `/v1/allocation/${enc(id)}`, async (a) => {
    const live = a.desired_status === 'run' && !['complete', 'failed', 'lost'].includes(a.client_status);
    const group = (a.job?.task_groups || []).find((g) => g.name === a.task_group) || { tasks: [], volumes: {} };
    fill(head,
      h('div', { class: 'actions' }, live && can('alloc-lifecycle')
        ? action('Restart', `Restart alloc ${a.id.slice(0, 8)}?`, `Every task of ${a.name} is restarted in place.`,
          () => api(`/v1/client/allocation/${enc(a.id)}/restart`, { method: 'POST', body: {} }), false)
        : null,
      live && can('alloc-lifecycle')
        ? action('Stop', `Stop alloc ${a.id.slice(0, 8)}?`, `${a.name} is stopped; the scheduler places a replacement when its job still wants one.`,
          () => api(`/v1/allocation/${enc(a.id)}/stop`, { method: 'POST' }))
        : null),
      facts([
        ['Name', a.name], ['Job', link(`#/jobs/${enc(a.job_id)}`, a.job_id)],
        ['Node', shortId(a.node_id, `#/nodes/${enc(a.node_id)}`)],
        ['Desired', [status(a.desired_status), a.desired_description ? ` — ${a.desired_description}` : '']],
        ['Status', [status(a.client_status), a.client_description ? ` — ${a.client_description}` : '']],
        ['Job version', a.job?.version], ['Created', ago(a.create_time_ms)], ['Modified', ago(a.modify_time_ms)],
      ]));
    let usage = {};
    if (live) {
      try { usage = (await getJson(`/v1/client/allocation/${enc(a.id)}/stats`, page.signal)).tasks || {}; } catch { usage = {}; }
    }
    fill(tasks, group.tasks.map((t) => taskPart(t, a.task_states?.[t.name], usage[t.name])));
    fill(volumes, volumePart(a, group));
    const names = group.tasks.map((t) => t.name);
    if (!logTasks || logTasks.join() !== names.join()) {
      logTasks = names;
      fill(logs, logTail(page, a.id, names));
    }
  }, (e) => failure(head, e));
  return [h('h1', {}, `Alloc ${id.slice(0, 8)}`), head, h('h2', {}, 'Tasks'), tasks, h('h2', {}, 'CSI volumes'), volumes,
    h('h2', {}, 'Logs'), logs];
}

function taskPart(t, st, usage) {
  const s = st || { state: 'pending', events: [] };
  const events = [...(s.events || [])].reverse();
  const mem = usage?.resource_usage?.memory_stats;
  const cpu = usage?.resource_usage?.cpu_stats;
  return h('div', { class: 'task' },
    h('h3', {}, `Task ${t.name} `, status(s.state, s.failed ? 'failed' : ''), s.failed ? h('span', { class: 's-failed' }, ' (failed)') : null),
    facts([
      ['Driver', t.driver], ['Restarts', s.restarts ?? 0],
      ['Started', ago(s.started_at_ms)], s.finished_at_ms ? ['Finished', ago(s.finished_at_ms)] : null,
      ['Asks', `${t.resources?.cpu ?? '—'} MHz CPU, ${t.resources?.memory_mb ?? '—'} MiB memory`],
      mem && mem.measured?.length ? ['Memory', `${bytes(mem.usage)}${mem.limit ? ` of ${bytes(mem.limit)}` : ''}`] : null,
      cpu && cpu.measured?.length ? ['CPU', `${cpu.millicores} millicores (${cpu.percent.toFixed(1)} %)`] : null,
    ]),
    table(['Time', 'Type', 'Message'], events.map((e) => [ago(e.time_ms), e.type, e.message]), 'No events yet.'));
}

function volumePart(a, group) {
  const rows = [];
  for (const t of group.tasks) {
    for (const m of t.volume_mounts || []) {
      const v = (group.volumes || {})[m.volume];
      if (!v || v.type !== 'csi') continue;
      const source = v.per_alloc ? `${v.source}[${a.index}]` : v.source;
      const stats = (a.csi_volume_stats || {})[m.volume] || (a.csi_volume_stats || {})[source];
      rows.push([link(`#/volumes/${enc(source)}`, source), t.name, m.destination, m.read_only || v.read_only ? 'read-only' : 'read-write',
        v.access_mode, stats ? statsText(stats) : '—']);
    }
  }
  return table(['Volume', 'Task', 'Destination', 'Mode', 'Access', 'Usage'], rows, 'This alloc mounts no CSI volume.');
}

/** A mounted volume's stats as the client last collected them. */
function statsText(s) {
  const parts = [];
  if (s.bytes_total) {
    const pct = Math.round((100 * (s.bytes_used || 0)) / s.bytes_total);
    parts.push(meter(pct), ` ${bytes(s.bytes_used)} of ${bytes(s.bytes_total)}`);
  }
  if (s.condition?.abnormal) parts.push(h('span', { class: 's-failed' }, ` abnormal: ${s.condition.message || ''}`));
  if (s.error) parts.push(h('span', { class: 's-failed' }, ` ${s.error}`));
  if (!parts.length) return h('span', { class: 'muted' }, 'not reported');
  return h('span', { title: s.collected_at_ms ? `collected ${new Date(s.collected_at_ms).toLocaleString()}` : null }, parts);
}

/** A bar `pct` percent full (set through the style object: the page's
 * content security policy allows no inline style attribute). */
function meter(pct) {
  const fillEl = h('span');
  fillEl.style.width = `${Math.max(0, Math.min(100, pct))}%`;
  return h('span', { class: 'bar', role: 'img', 'aria-label': `${pct}% used` }, fillEl);
}

/** The live tail of a task's stdout or stderr: the last lines, then
 * everything after them as it is written, across rotations (the cursor
 * names the file and the offset). */
function logTail(page, allocId, tasks) {
  if (!tasks.length) return h('p', { class: 'muted' }, 'No tasks.');
  const task = h('select', { 'aria-label': 'Task' }, tasks.map((t) => h('option', { value: t }, t)));
  const stream = h('select', { 'aria-label': 'Stream' }, h('option', { value: 'stdout' }, 'stdout'), h('option', { value: 'stderr' }, 'stderr'));
  const state = h('span', { class: 'muted', role: 'status' });
  const pre = h('pre', { class: 'logs', tabindex: '0', 'aria-label': 'Log output', 'data-log': '' });
  let tail = null;
  const start = () => {
    if (tail) tail.abort();
    tail = new AbortController();
    page.signal.addEventListener('abort', () => tail.abort(), { once: true });
    pre.textContent = '';
    followLogs(tail.signal, allocId, task.value, stream.value, pre, state);
  };
  task.addEventListener('change', start);
  stream.addEventListener('change', start);
  start();
  return [h('div', { class: 'logs-bar' }, h('label', {}, 'Task ', task), h('label', {}, 'Stream ', stream), state), pre];
}

async function followLogs(signal, allocId, task, stream, pre, state) {
  const decoder = new TextDecoder();
  let cursor = null;
  let backoff = 500;
  const base = `/v1/client/fs/logs/${enc(allocId)}?task=${enc(task)}&type=${stream}`;
  while (!signal.aborted) {
    try {
      const url = cursor ? `${base}&file=${cursor.file}&offset=${cursor.offset}&wait=30s` : `${base}&lines=200`;
      const resp = await api(url, { signal });
      const chunk = decoder.decode(await resp.arrayBuffer(), { stream: true });
      cursor = { file: resp.headers.get('x-berth-log-file'), offset: resp.headers.get('x-berth-log-offset') };
      const taskState = resp.headers.get('x-berth-log-task-state');
      state.textContent = resp.headers.get('x-berth-log-lost') ? 'some output was rotated away before it was read'
        : taskState === 'dead' ? 'the task has stopped' : 'following';
      if (chunk) {
        const atEnd = pre.scrollHeight - pre.scrollTop - pre.clientHeight < 30;
        pre.append(chunk);
        trimLog(pre);
        if (atEnd) pre.scrollTop = pre.scrollHeight;
      }
      backoff = 500;
      if (taskState === 'dead' && !chunk) await sleep(5000, signal);
    } catch (e) {
      if (signal.aborted) return;
      state.textContent = e.message;
      await sleep(backoff, signal);
      backoff = Math.min(backoff * 2, 10000);
    }
  }
}

/** Keeps the tail's text under about 1 MB. */
function trimLog(pre) {
  const max = 1 << 20;
  if (pre.textContent.length > max) pre.textContent = pre.textContent.slice(-max / 2);
}

function nodesPage(page) {
  const list = region('nodes');
  follow(page, '/v1/nodes', (nodes) => {
    nodes.sort((a, b) => a.name.localeCompare(b.name));
    fill(list, table(['Name', 'ID', 'Datacenter', 'Class', 'Status', 'Eligibility', 'Drain', { text: 'Allocs', class: 'num' }, 'Last heartbeat'],
      nodes.map((n) => [link(`#/nodes/${enc(n.id)}`, n.name), shortId(n.id), n.datacenter, n.node_class || '—',
        status(n.status), status(n.scheduling_eligibility), n.drain ? status('draining') : 'no', num(n.allocs_running),
        ago(n.last_heartbeat_ms)]), 'No nodes have registered.'));
  }, (e) => failure(list, e));
  return [h('h1', {}, 'Nodes'), list];
}

function nodePage(page, id) {
  const title = h('h1', {}, `Node ${id.length > 12 ? id.slice(0, 8) : id}`);
  const head = region('node');
  const allocs = region('allocs');
  follow(page, `/v1/node/${enc(id)}`, (n) => {
    title.textContent = `Node ${n.name}`;
    document.title = `${title.textContent} · berth`;
    const res = (r) => (r ? `${r.cpu} MHz, ${r.memory_mb} MiB memory, ${r.disk_mb} MiB disk` : '—');
    const plugins = [];
    for (const [kind, map] of [['controller', n.csi_controller_plugins], ['node', n.csi_node_plugins]]) {
      for (const p of Object.values(map || {})) {
        plugins.push([link(`#/plugins/${enc(p.plugin_id)}`, p.plugin_id), kind, status(p.healthy ? 'healthy' : 'unhealthy'),
          p.health_description, p.version, shortId(p.alloc_id, `#/allocs/${enc(p.alloc_id)}`)]);
      }
    }
    fill(head,
      h('div', { class: 'actions' }, can('node-write') ? [
        n.drain
          ? action('Stop drain', `Stop draining ${n.name}?`, 'The drain ends; the node stays ineligible until you make it eligible.',
            () => api(`/v1/node/${enc(n.id)}/drain`, { method: 'POST', body: { enable: false } }), false)
          : action('Drain', `Drain ${n.name}?`, 'Its allocs are moved to other nodes (deadline 1h) and it takes no new ones.',
            () => api(`/v1/node/${enc(n.id)}/drain`, { method: 'POST', body: { enable: true, deadline: '1h' } })),
        n.scheduling_eligibility === 'eligible'
          ? action('Make ineligible', `Make ${n.name} ineligible?`, 'It takes no new allocs; what runs there keeps running.',
            () => api(`/v1/node/${enc(n.id)}/eligibility`, { method: 'POST', body: { eligible: false } }), false)
          : action('Make eligible', `Make ${n.name} eligible?`, 'The scheduler may place allocs there again.',
            () => api(`/v1/node/${enc(n.id)}/eligibility`, { method: 'POST', body: { eligible: true } }), false),
      ] : null),
      h('div', { class: 'cols' },
        facts([
          ['ID', shortId(n.id)], ['Status', status(n.status)], ['Eligibility', status(n.scheduling_eligibility)],
          ['Drain', n.drain ? status('draining') : 'no'], ['Datacenter', n.datacenter], ['Class', n.node_class || '—'],
          ['Last heartbeat', ago(n.last_heartbeat_ms)], ['Kernel', n.attributes?.['kernel.release']],
          ['OS', `${n.attributes?.['os.name'] ?? ''} ${n.attributes?.['os.version'] ?? ''}`],
        ]),
        facts([
          ['Total', res(n.total_resources || n.resources)], ['Reserved', res(n.reserved)], ['Allocated', res(n.allocated_resources)],
        ])),
      h('h2', {}, 'Drivers'),
      table(['Driver', 'Health', 'Detail', 'Updated'], Object.entries(n.driver_info || {}).map(([d, i]) => [
        d, status(i.healthy ? 'healthy' : 'unhealthy'), i.health_description, ago(i.update_time_ms)]), 'No drivers.'),
      h('h2', {}, 'CSI plugins'),
      table(['Plugin', 'Kind', 'Health', 'Detail', 'Version', 'Alloc'], plugins, 'No CSI plugins run here.'),
      h('h2', {}, 'CSI volumes'),
      table(['Volume', 'Plugin', 'Alloc', 'Mode', 'Claim'], (n.csi_volumes || []).map((v) => [
        link(`#/volumes/${enc(v.volume_id)}`, v.volume_id), v.plugin_id, shortId(v.alloc_id, `#/allocs/${enc(v.alloc_id)}`),
        v.mode || v.access_mode, status(v.state)]), 'No CSI volume is claimed here.'),
      h('h2', {}, 'Events'),
      table(['Time', 'Subsystem', 'Message', { text: 'Count', class: 'num' }], [...(n.events || [])].reverse().map((e) => [
        ago(e.timestamp), e.subsystem, e.message, num(e.count)])));
  }, (e) => failure(head, e));
  follow(page, `/v1/node/${enc(id)}/allocations`, (list) => {
    list.sort((a, b) => b.create_index - a.create_index);
    fill(allocs, allocTable(list, { job: true }));
  }, (e) => failure(allocs, e));
  return [title, head, h('h2', {}, 'Allocations'), allocs];
}

function volumesPage(page) {
  const list = region('volumes');
  follow(page, '/v1/volumes', (vols) => {
    fill(list, table(['ID', 'Name', 'Plugin', 'Schedulable', 'Capacity', 'Access modes', { text: 'Claims', class: 'num' }],
      vols.map((v) => [link(`#/volumes/${enc(v.id)}`, v.id), v.name, link(`#/plugins/${enc(v.plugin_id)}`, v.plugin_id),
        v.schedulable ? 'yes' : status('no', 's-failed'), bytes(v.capacity),
        (v.capabilities || []).map((c) => c.access_mode).join(', '),
        num(Object.keys(v.read_claims || {}).length + Object.keys(v.write_claims || {}).length)]),
      'No volumes: berth volume create FILE makes one.'));
  }, (e) => failure(list, e));
  return [h('h1', {}, 'CSI volumes'), list];
}

function volumePage(page, id) {
  const head = region('volume');
  follow(page, `/v1/volume/csi/${enc(id)}`, (v) => {
    const nodes = [...new Set((v.claim_allocs || []).map((c) => c.node_id))];
    fill(head,
      h('div', { class: 'actions' }, can('csi-write-volume') ? nodes.map((nid) => {
        const name = (v.claim_allocs.find((c) => c.node_id === nid) || {}).node_name || nid.slice(0, 8);
        return action(`Detach from ${name}`, `Detach ${v.id} from ${name}?`,
          `The node unmounts ${v.id} and its claims there are released. Tasks that use it there lose it.`,
          () => api(`/v1/volume/csi/${enc(v.id)}/detach?node=${enc(nid)}`, { method: 'DELETE' }));
      }) : null),
      facts([
        ['Name', v.name], ['Plugin', link(`#/plugins/${enc(v.plugin_id)}`, v.plugin_id)], ['Provider', v.provider],
        ['External ID', shortId(v.external_id)], ['Schedulable', v.schedulable ? 'yes' : status('no', 's-failed')],
        ['Capacity', `${bytes(v.capacity)} (min ${bytes(v.capacity_min)}, max ${bytes(v.capacity_max)})`],
        ['Plugin health', v.plugin ? `${v.plugin.controllers_healthy}/${v.plugin.controllers_expected} controllers, ${v.plugin.nodes_healthy}/${v.plugin.nodes_expected} nodes` : '—'],
        ['Topology', (v.accessible_topology || []).map((t) => Object.entries(t.segments).map(([k, x]) => `${k}=${x}`).join(', ')).join('; ') || 'any'],
      ]),
      h('h2', {}, 'Capabilities'),
      table(['Access mode', 'Attachment'], (v.capabilities || []).map((c) => [c.access_mode, c.attachment_mode])),
      h('h2', {}, 'Claims'),
      table(['Alloc', 'Job', 'Node', 'Mode', 'Access', 'State', 'Alloc status', 'Usage'], (v.claim_allocs || []).map((c) => [
        shortId(c.alloc_id, `#/allocs/${enc(c.alloc_id)}`), link(`#/jobs/${enc(c.job_id)}`, c.job_id),
        link(`#/nodes/${enc(c.node_id)}`, c.node_name || c.node_id.slice(0, 8)), c.mode, c.access_mode, status(c.state),
        status(c.client_status), c.volume_stats ? statsText(c.volume_stats) : '—']), 'No claims: the volume is free.'));
  }, (e) => failure(head, e));
  return [h('h1', {}, `Volume ${id}`), head];
}

function pluginsPage(page) {
  const list = region('plugins');
  follow(page, '/v1/plugins', (plugins) => {
    fill(list, table(['ID', 'Provider', 'Version', 'Controllers', 'Nodes'], plugins.map((p) => [
      link(`#/plugins/${enc(p.id)}`, p.id), p.provider, p.version,
      healthy(p.controllers_healthy, p.controllers_expected), healthy(p.nodes_healthy, p.nodes_expected)]),
    'No CSI plugins: run a job with a csi_plugin block.'));
  }, (e) => failure(list, e));
  return [h('h1', {}, 'CSI plugins'), list];
}

function healthy(n, of) {
  return h('span', { class: n >= of && of > 0 ? 's-healthy' : n < of ? 's-unhealthy' : '' }, `${n}/${of} healthy`);
}

function pluginPage(page, id) {
  const head = region('plugin');
  follow(page, `/v1/plugin/csi/${enc(id)}`, (p) => {
    const instances = [];
    for (const [kind, map] of [['controller', p.controllers], ['node', p.nodes]]) {
      for (const [nid, i] of Object.entries(map || {})) {
        instances.push([kind, link(`#/nodes/${enc(nid)}`, p.instance_nodes?.[nid]?.name || nid.slice(0, 8)),
          status(i.healthy ? 'healthy' : 'unhealthy'), i.health_description, shortId(i.alloc_id, `#/allocs/${enc(i.alloc_id)}`)]);
      }
    }
    fill(head,
      facts([
        ['Provider', p.provider], ['Version', p.version],
        ['Controllers', healthy(p.controllers_healthy, p.controllers_expected)], ['Nodes', healthy(p.nodes_healthy, p.nodes_expected)],
        ['Controller capabilities', (p.controller_capabilities || []).join(', ') || '—'],
        ['Node capabilities', (p.node_capabilities || []).join(', ') || '—'],
        ['Volumes', p.volume_count ?? '—'],
      ]),
      h('h2', {}, 'Instances'), table(['Kind', 'Node', 'Health', 'Detail', 'Alloc'], instances, 'No instance runs.'),
      h('h2', {}, 'Allocations'),
      table(['Alloc', 'Job', 'Task', 'Node', 'Status', 'Created'], (p.allocations || []).map((a) => [
        shortId(a.id, `#/allocs/${enc(a.id)}`), link(`#/jobs/${enc(a.job_id)}`, a.job_id), a.task,
        link(`#/nodes/${enc(a.node_id)}`, a.node_name || a.node_id.slice(0, 8)), status(a.client_status), ago(a.create_time_ms)])));
  }, (e) => failure(head, e));
  return [h('h1', {}, `Plugin ${id}`), head];
}

// ---- what the token may do ---------------------------------------------------------

/** Whether the token may take an action that needs `need` (a namespace
 * capability such as `alloc-lifecycle`, or `node-write`), as the servers
 * resolved its policies (`acl` of `GET /v1/acl/token/self`). With ACLs
 * off there is no token to ask about: yes. A refused action still says
 * why. */
function can(need) {
  if (!self) return true;
  const acl = self.acl || {};
  if (acl.management) return true;
  if (need === 'node-write') return acl.node === 'write';
  return (acl.capabilities || []).includes(need);
}

// ---- routing -----------------------------------------------------------------------

const routes = [
  [/^#\/jobs\/?$/, (p) => jobsPage(p), 'jobs'],
  [/^#\/jobs\/([^/]+)$/, (p, id) => jobPage(p, id), 'jobs'],
  [/^#\/allocs\/([^/]+)$/, (p, id) => allocPage(p, id), 'jobs'],
  [/^#\/nodes\/?$/, (p) => nodesPage(p), 'nodes'],
  [/^#\/nodes\/([^/]+)$/, (p, id) => nodePage(p, id), 'nodes'],
  [/^#\/volumes\/?$/, (p) => volumesPage(p), 'volumes'],
  [/^#\/volumes\/([^/]+)$/, (p, id) => volumePage(p, id), 'volumes'],
  [/^#\/plugins\/?$/, (p) => pluginsPage(p), 'plugins'],
  [/^#\/plugins\/([^/]+)$/, (p, id) => pluginPage(p, id), 'plugins'],
];

let current = null;

function route() {
  if (current) current.abort();
  current = new AbortController();
  const hash = location.hash || '#/jobs';
  for (const [re, render, section] of routes) {
    const m = hash.match(re);
    if (!m) continue;
    for (const a of document.querySelectorAll('nav a')) {
      if (a.dataset.section === section) a.setAttribute('aria-current', 'page');
      else a.removeAttribute('aria-current');
    }
    const parts = render(current, ...m.slice(1).map(decodeURIComponent));
    main.replaceChildren();
    append(main, parts);
    document.title = `${main.querySelector('h1')?.textContent || 'berth'} · berth`;
    return;
  }
  main.replaceChildren(h('h1', {}, 'Not found'), h('p', {}, 'No page at ', h('code', {}, hash), '. ', link('#/jobs', 'Jobs')));
}

window.addEventListener('hashchange', () => { route(); main.focus(); });
// Leaving the page ends its blocking queries at once: a browser allows
// only a few connections to one agent, and one held by a page gone would
// stall the next.
window.addEventListener('pagehide', () => { if (current) current.abort(); });
whoAmI().then(route);
