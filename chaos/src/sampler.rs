//! Promise 1, sampled all along: every 20 ms the processes of each writer
//! job are read, and the allocs they belong to counted (a task's command
//! line names its alloc's directory); a moment with processes of two or
//! more allocs is kept, with their command lines. Counting allocs, not
//! processes, leaves out a task's own forks (a shell's child before it
//! execs carries the shell's command line).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_tests::cluster::marker;

/// Two or more writers of one volume seen at once.
#[derive(Debug, Clone)]
pub struct Overlap {
    /// Since the sampler started.
    pub at: Duration,
    pub job: String,
    /// Each process: its pid and command line.
    pub processes: Vec<(i32, String)>,
}

pub struct WriterSampler {
    stop: Arc<AtomicBool>,
    overlaps: Arc<Mutex<Vec<Overlap>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl WriterSampler {
    pub fn start(jobs: Vec<String>) -> WriterSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let overlaps = Arc::new(Mutex::new(Vec::new()));
        let (st, found) = (stop.clone(), overlaps.clone());
        let started = Instant::now();
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::SeqCst) {
                for job in &jobs {
                    let needle = format!("/{} ", marker(job));
                    let processes: Vec<(i32, String)> =
                        berth_tests::processes_with_cmdline(&needle)
                            .into_iter()
                            .filter_map(|p| {
                                let cmd = std::fs::read(format!("/proc/{p}/cmdline")).ok()?;
                                let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                                cmd.contains(&needle).then_some((p, cmd))
                            })
                            .collect();
                    let allocs: BTreeSet<&str> =
                        processes.iter().filter_map(|(_, c)| alloc_of(c)).collect();
                    if allocs.len() > 1 {
                        if let Ok(mut f) = found.lock() {
                            f.push(Overlap {
                                at: started.elapsed(),
                                job: job.clone(),
                                processes,
                            });
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        WriterSampler {
            stop,
            overlaps,
            thread: Some(thread),
        }
    }

    /// The overlaps seen so far (the first few of each job).
    pub fn overlaps(&self) -> Vec<Overlap> {
        self.overlaps.lock().map(|o| o.clone()).unwrap_or_default()
    }
}

/// The alloc ID a task's command line names: the directory after
/// `/alloc/` in its marker's path (`<data>/alloc/<id>/alloc/marker-...`).
fn alloc_of(cmdline: &str) -> Option<&str> {
    let at = cmdline.find("/alloc/")? + "/alloc/".len();
    cmdline[at..].split('/').next()
}

impl Drop for WriterSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tasks_alloc_is_read_from_its_command_line() {
        let cmd = "/bin/sh -c while :; do sleep 0.2; done \
                   /tmp/berth-e2e-x/data/alloc/389f381a-92c6/alloc/marker-w-1 ";
        assert_eq!(alloc_of(cmd), Some("389f381a-92c6"));
        assert_eq!(alloc_of("sleep 0.2"), None);
    }
}
