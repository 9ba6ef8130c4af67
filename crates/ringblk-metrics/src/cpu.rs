//! CPU affinity: pinning a thread, and which CPUs this process may use.

use std::io;

/// Pins the calling thread to `cpu`. A CPU past what `cpu_set_t` can hold
/// (`CPU_SETSIZE`, 1024) is an error, not a panic.
pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "CPU {cpu} is past the {} a CPU set holds",
                libc::CPU_SETSIZE
            ),
        ));
    }
    // SAFETY: cpu_set_t is a plain bit array for which all-zeroes is the
    // valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` < CPU_SETSIZE was checked above, so CPU_SET writes
    // inside `set` (libc's CPU_SET panics past it).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: pid 0 is the calling thread; `set` is a valid cpu_set_t of the
    // size passed, and the kernel only reads it.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The CPUs this process may run on (its affinity mask).
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    // SAFETY: as above, all-zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is this thread; the kernel writes at most the size
    // passed into `set`.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: every index is below CPU_SETSIZE; CPU_ISSET only reads.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Checks a `--cpus` list against the CPUs this process may use, with a
/// one-line error naming the first that is not one of them.
pub fn check_cpus(cpus: &[usize]) -> Result<(), String> {
    let allowed =
        allowed_cpus().map_err(|e| format!("--cpus: cannot read the CPU affinity: {e}"))?;
    match cpus.iter().find(|c| !allowed.contains(c)) {
        Some(c) => Err(format!(
            "--cpus: CPU {c} is not one this process can run on ({})",
            ranges(&allowed)
        )),
        None => Ok(()),
    }
}

/// `0-3,8,10-11`.
fn ranges(cpus: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    out.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpus_outside_the_set_are_errors_not_panics() {
        assert!(pin_current_thread(libc::CPU_SETSIZE as usize).is_err());
        assert!(pin_current_thread(usize::MAX).is_err());
        let allowed = allowed_cpus().unwrap();
        assert!(!allowed.is_empty());
        assert!(check_cpus(&allowed).is_ok());
        let e = check_cpus(&[allowed[0], 4096]).unwrap_err();
        assert!(e.contains("CPU 4096 is not one"), "{e}");
    }

    #[test]
    fn ranges_are_compact() {
        assert_eq!(ranges(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(ranges(&[5]), "5");
    }
}
