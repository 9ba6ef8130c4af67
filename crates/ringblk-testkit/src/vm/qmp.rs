//! A QMP client, enough to drive a migration: one command at a time over
//! QEMU's `-qmp unix:PATH,server=on,wait=off` socket, events skipped.

use std::fmt;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// How long QEMU may take to answer one command.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// A command QEMU answered with an error.
#[derive(Debug)]
pub struct QmpError {
    pub class: String,
    pub desc: String,
}

impl fmt::Display for QmpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.class, self.desc)
    }
}

pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    name: &'static str,
}

impl Qmp {
    /// Connects to the QMP socket of the QEMU `name` (retrying while QEMU
    /// starts, for up to `limit`, unless `alive` says it has exited) and
    /// leaves capabilities negotiation mode.
    pub fn connect(
        name: &'static str,
        path: &Path,
        limit: Duration,
        mut alive: impl FnMut() -> bool,
    ) -> Qmp {
        let deadline = Instant::now() + limit;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) => {
                    assert!(
                        alive(),
                        "{name}: QEMU exited before its QMP socket accepted"
                    );
                    assert!(
                        Instant::now() < deadline,
                        "{name}: no QMP socket at {} within {limit:?}: {e}",
                        path.display()
                    );
                    thread::sleep(Duration::from_millis(50));
                }
            }
        };
        stream
            .set_read_timeout(Some(REPLY_TIMEOUT))
            .expect("QMP read timeout");
        let writer = stream.try_clone().expect("QMP socket");
        let mut qmp = Qmp {
            reader: BufReader::new(stream),
            writer,
            name,
        };
        let greeting = qmp.read_message();
        assert!(
            greeting.get("QMP").is_some(),
            "{name}: expected the QMP greeting, got {greeting}"
        );
        qmp.execute("qmp_capabilities", json!({}))
            .unwrap_or_else(|e| panic!("{name}: qmp_capabilities: {e}"));
        qmp
    }

    /// Runs `command` with `arguments` (an object); its `return` value, or
    /// the error QEMU answered.
    pub fn execute(&mut self, command: &str, arguments: Value) -> Result<Value, QmpError> {
        let mut line = json!({ "execute": command, "arguments": arguments }).to_string();
        line.push('\n');
        self.writer
            .write_all(line.as_bytes())
            .unwrap_or_else(|e| panic!("{}: sending {command}: {e}", self.name));
        loop {
            let reply = self.read_message();
            if let Some(ret) = reply.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = reply.get("error") {
                let field = |k: &str| err.get(k).and_then(Value::as_str).unwrap_or("?").into();
                return Err(QmpError {
                    class: field("class"),
                    desc: field("desc"),
                });
            }
            // An event ({"event": ...}): not ours to answer.
        }
    }

    /// `execute` that panics on an error.
    pub fn run(&mut self, command: &str, arguments: Value) -> Value {
        self.execute(command, arguments)
            .unwrap_or_else(|e| panic!("{}: {command}: {e}", self.name))
    }

    /// Asks QEMU to exit. It may close the socket before its answer is
    /// read: whether the process exits is for the caller to check.
    pub fn quit(mut self) {
        let _ = self.writer.write_all(b"{\"execute\": \"quit\"}\n");
        let mut line = String::new();
        let _ = self.reader.read_line(&mut line);
    }

    fn read_message(&mut self) -> Value {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) => panic!("{}: QEMU closed its QMP socket", self.name),
            Ok(_) => serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("{}: QMP sent {line:?}: {e}", self.name)),
            Err(e) => panic!("{}: reading QMP: {e}", self.name),
        }
    }
}
