//! [`Browser`]: headless Chromium (Debian's `chromium`) driven over the
//! DevTools protocol, for the web UI's tests: one tab at a given window
//! size, navigation, scripts evaluated in the page, screenshots, the bytes
//! each load transferred, and every console error and uncaught exception
//! the page raised. Chromium and its profile are removed on drop.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use serde_json::{json, Value};
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Message, WebSocket};

/// A headless Chromium with one tab.
pub struct Browser {
    child: Child,
    _profile: tempfile::TempDir,
    ws: WebSocket<MaybeTlsStream<TcpStream>>,
    session: String,
    next_id: u64,
    /// Events read while waiting for an answer, not yet looked at.
    events: VecDeque<Value>,
    /// Console errors and uncaught exceptions, as text.
    errors: Vec<String>,
    /// Bytes transferred since the last [`Browser::navigate`].
    transferred: f64,
}

/// How long one DevTools call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

impl Browser {
    /// Starts Chromium with a tab of `width`×`height` CSS pixels.
    pub fn start(width: u32, height: u32) -> Result<Browser> {
        let found = Command::new("sh")
            .args(["-c", "command -v chromium"])
            .output()?
            .status
            .success();
        anyhow::ensure!(
            found,
            "chromium is not installed: apt-get install chromium (.ci/run does)"
        );
        let profile = tempfile::Builder::new()
            .prefix("berth-chromium-")
            .tempdir()?;
        let mut child = Command::new("chromium")
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--remote-debugging-port=0",
                &format!("--window-size={width},{height}"),
                &format!("--user-data-dir={}", profile.path().display()),
                "about:blank",
            ])
            .env("HOME", profile.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting chromium")?;
        let url = match devtools_url(&mut child) {
            Ok(url) => url,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
        };
        let (ws, _) = match tungstenite::connect(url.as_str()) {
            Ok(c) => c,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("connecting to chromium's DevTools at {url}: {e}");
            }
        };
        if let MaybeTlsStream::Plain(s) = ws.get_ref() {
            s.set_read_timeout(Some(Duration::from_millis(200)))?;
        }
        let mut b = Browser {
            child,
            _profile: profile,
            ws,
            session: String::new(),
            next_id: 0,
            events: VecDeque::new(),
            errors: Vec::new(),
            transferred: 0.0,
        };
        let target = b.call_browser("Target.createTarget", json!({ "url": "about:blank" }))?;
        let target = target["targetId"]
            .as_str()
            .context("no target ID")?
            .to_string();
        let attached = b.call_browser(
            "Target.attachToTarget",
            json!({ "targetId": target, "flatten": true }),
        )?;
        b.session = attached["sessionId"]
            .as_str()
            .context("no session ID")?
            .to_string();
        for domain in [
            "Page.enable",
            "Runtime.enable",
            "Log.enable",
            "Network.enable",
        ] {
            b.call(domain, json!({}))?;
        }
        // Every load is a first load: what it transfers is what a new
        // visitor's would.
        b.call("Network.setCacheDisabled", json!({ "cacheDisabled": true }))?;
        b.call(
            "Emulation.setDeviceMetricsOverride",
            json!({ "width": width, "height": height, "deviceScaleFactor": 1, "mobile": false }),
        )?;
        Ok(b)
    }

    /// Loads `url` and waits for its load event (a change of the
    /// fragment alone loads nothing: the page's own router follows it).
    pub fn navigate(&mut self, url: &str) -> Result<()> {
        self.drain();
        self.transferred = 0.0;
        self.events.retain(|e| e["method"] != "Page.loadEventFired");
        let answer = self.call("Page.navigate", json!({ "url": url }))?;
        if let Some(e) = answer["errorText"].as_str() {
            bail!("loading {url}: {e}");
        }
        if answer.get("loaderId").is_none() {
            return Ok(());
        }
        let deadline = Instant::now() + CALL_TIMEOUT;
        loop {
            if let Some(i) = self
                .events
                .iter()
                .position(|e| e["method"] == "Page.loadEventFired")
            {
                self.events.remove(i);
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{url} did not finish loading within {CALL_TIMEOUT:?}");
            }
            self.read_one()?;
        }
    }

    /// The value of `expression` in the page (awaited when a promise).
    pub fn eval(&mut self, expression: &str) -> Result<Value> {
        let answer = self.call(
            "Runtime.evaluate",
            json!({ "expression": expression, "returnByValue": true, "awaitPromise": true }),
        )?;
        if let Some(ex) = answer.get("exceptionDetails") {
            bail!("evaluating {expression}: {}", exception_text(ex));
        }
        Ok(answer["result"]["value"].clone())
    }

    /// The page's visible text.
    pub fn text(&mut self) -> Result<String> {
        Ok(self
            .eval("document.body.innerText")?
            .as_str()
            .unwrap_or_default()
            .to_string())
    }

    /// Waits until `expression` is truthy in the page; answers its value.
    pub fn wait_until(&mut self, what: &str, timeout: Duration, expression: &str) -> Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let v = self.eval(expression)?;
            let truthy =
                !matches!(&v, Value::Null | Value::Bool(false)) && v != json!(0) && v != json!("");
            if truthy {
                return Ok(v);
            }
            if Instant::now() > deadline {
                let text = self.text().unwrap_or_default();
                bail!("{what}: not within {timeout:?}; the page shows:\n{text}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until the page's text contains each of `needles`.
    pub fn wait_text(&mut self, timeout: Duration, needles: &[&str]) -> Result<()> {
        let list = serde_json::to_string(needles)?;
        self.wait_until(
            &format!("the page to show {needles:?}"),
            timeout,
            &format!("{list}.every((n) => document.body.innerText.includes(n))"),
        )
        .map(|_| ())
    }

    /// Clicks the first element `selector` matches whose text contains
    /// `text` (any, when empty).
    pub fn click(&mut self, selector: &str, text: &str) -> Result<()> {
        let found = self.eval(&format!(
            "(() => {{ const el = [...document.querySelectorAll({sel})]\
             .find((e) => e.textContent.includes({text})); \
             if (!el) return false; el.click(); return true; }})()",
            sel = serde_json::to_string(selector)?,
            text = serde_json::to_string(text)?,
        ))?;
        anyhow::ensure!(
            found == json!(true),
            "nothing matches {selector} with text {text:?}"
        );
        Ok(())
    }

    /// Makes the tab `width`×`height` CSS pixels.
    pub fn resize(&mut self, width: u32, height: u32) -> Result<()> {
        self.call(
            "Emulation.setDeviceMetricsOverride",
            json!({ "width": width, "height": height, "deviceScaleFactor": 1, "mobile": false }),
        )
        .map(|_| ())
    }

    /// Presses and releases `key` ("Tab", "Enter" or "Escape") as the
    /// keyboard would, on whatever has the focus.
    pub fn press(&mut self, key: &str) -> Result<()> {
        let code = match key {
            "Tab" => 9,
            "Enter" => 13,
            "Escape" => 27,
            other => bail!("no key code for {other:?}"),
        };
        // Enter types a carriage return: that is what activates a link
        // or a button.
        let text = if key == "Enter" { "\r" } else { "" };
        for kind in ["keyDown", "keyUp"] {
            self.call(
                "Input.dispatchKeyEvent",
                json!({ "type": kind, "key": key, "code": key, "text": text,
                        "windowsVirtualKeyCode": code, "nativeVirtualKeyCode": code }),
            )?;
        }
        Ok(())
    }

    /// A PNG of the tab, written to `path`.
    pub fn screenshot(&mut self, path: &Path) -> Result<()> {
        let shot = self.call("Page.captureScreenshot", json!({ "format": "png" }))?;
        let data = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().context("no screenshot data")?)?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, data)?;
        Ok(())
    }

    /// Every console error and uncaught exception so far, emptied.
    pub fn take_errors(&mut self) -> Vec<String> {
        self.drain();
        std::mem::take(&mut self.errors)
    }

    /// Bytes the tab transferred (headers and bodies, as sent) since the
    /// last navigation.
    pub fn transferred(&mut self) -> u64 {
        self.drain();
        self.transferred as u64
    }

    /// Reads whatever has arrived without waiting long.
    fn drain(&mut self) {
        while let Ok(true) = self.read_one() {}
        self.events.retain(|e| e["method"] == "Page.loadEventFired");
    }

    /// A call in the tab's session.
    fn call(&mut self, method: &str, params: Value) -> Result<Value> {
        let session = self.session.clone();
        self.send(method, params, Some(&session))
    }

    /// A call to the browser itself.
    fn call_browser(&mut self, method: &str, params: Value) -> Result<Value> {
        self.send(method, params, None)
    }

    fn send(&mut self, method: &str, params: Value, session: Option<&str>) -> Result<Value> {
        self.next_id += 1;
        let id = self.next_id;
        let mut msg = json!({ "id": id, "method": method, "params": params });
        if let Some(s) = session {
            msg["sessionId"] = json!(s);
        }
        self.ws
            .send(Message::text(msg.to_string()))
            .with_context(|| format!("sending {method}"))?;
        let deadline = Instant::now() + CALL_TIMEOUT;
        loop {
            if let Some(answer) = self.take_answer(id) {
                if let Some(e) = answer.get("error") {
                    bail!("{method}: {e}");
                }
                return Ok(answer["result"].clone());
            }
            if Instant::now() > deadline {
                bail!("{method}: no answer within {CALL_TIMEOUT:?}");
            }
            self.read_one()?;
        }
    }

    fn take_answer(&mut self, id: u64) -> Option<Value> {
        let i = self.events.iter().position(|m| m["id"] == json!(id))?;
        self.events.remove(i)
    }

    /// Reads one message (false when none came within the read timeout),
    /// noting errors and transfers as they pass.
    fn read_one(&mut self) -> Result<bool> {
        let msg = match self.ws.read() {
            Ok(m) => m,
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(false)
            }
            Err(e) => bail!("reading from chromium: {e}"),
        };
        let Message::Text(text) = msg else {
            return Ok(true);
        };
        let v: Value = serde_json::from_str(text.as_str())?;
        match v["method"].as_str() {
            Some("Runtime.exceptionThrown") => self
                .errors
                .push(exception_text(&v["params"]["exceptionDetails"])),
            Some("Runtime.consoleAPICalled") if v["params"]["type"] == "error" => {
                let args: Vec<String> = v["params"]["args"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|a| {
                        a["value"]
                            .as_str()
                            .map(str::to_string)
                            .unwrap_or_else(|| a["description"].to_string())
                    })
                    .collect();
                self.errors
                    .push(format!("console.error: {}", args.join(" ")));
            }
            Some("Log.entryAdded") if v["params"]["entry"]["level"] == "error" => {
                let e = &v["params"]["entry"];
                self.errors.push(format!(
                    "{}: {} {}",
                    e["source"].as_str().unwrap_or("log"),
                    e["text"].as_str().unwrap_or_default(),
                    e["url"].as_str().unwrap_or_default()
                ));
            }
            Some("Network.loadingFinished") => {
                self.transferred += v["params"]["encodedDataLength"].as_f64().unwrap_or(0.0);
            }
            Some("Page.loadEventFired") => self.events.push_back(v),
            Some(_) => {}
            None => self.events.push_back(v),
        }
        Ok(true)
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.call_browser("Browser.close", json!({}));
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The DevTools WebSocket address Chromium prints on stderr as it starts.
fn devtools_url(child: &mut Child) -> Result<String> {
    let stderr = child.stderr.take().context("no stderr")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut sent = false;
        let mut seen = Vec::new();
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if !sent {
                if let Some(url) = line.strip_prefix("DevTools listening on ") {
                    let _ = tx.send(Ok(url.trim().to_string()));
                    sent = true;
                } else {
                    seen.push(line);
                }
            }
        }
        if !sent {
            let _ = tx.send(Err(seen.join("\n")));
        }
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(Ok(url)) => Ok(url),
        Ok(Err(out)) => bail!("chromium exited before it listened:\n{out}"),
        Err(_) => bail!("chromium did not print its DevTools address within 30 s"),
    }
}

/// An exception's text, with where it was thrown.
fn exception_text(ex: &Value) -> String {
    let what = ex["exception"]["description"]
        .as_str()
        .or_else(|| ex["text"].as_str())
        .unwrap_or("exception");
    format!(
        "{what} at {}:{}",
        ex["url"].as_str().unwrap_or("?"),
        ex["lineNumber"]
    )
}
