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

/// Parses a CPU list as taskset(1) and cpuset(7) write it: numbers and
/// inclusive ranges, comma-separated (`0-3,8,10-11`), in any order; the
/// empty string is the empty list. The CPUs come out in the order given,
/// a range's in ascending order, each once.
pub fn parse_list(s: &str) -> Result<Vec<usize>, String> {
    let mut cpus: Vec<usize> = Vec::new();
    if s.trim().is_empty() {
        return Ok(cpus);
    }
    let bad = || format!("'{s}' is not a CPU list like 0-3,8,10-11");
    for item in s.split(',') {
        let item = item.trim();
        let (first, last) = match item.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (item, item),
        };
        let (Ok(first), Ok(last)) = (first.parse::<usize>(), last.parse::<usize>()) else {
            return Err(bad());
        };
        if first > last {
            return Err(format!("'{s}': the range {item} runs backwards"));
        }
        if last >= libc::CPU_SETSIZE as usize {
            return Err(format!(
                "'{s}': CPU {last} is past the {} a CPU set holds",
                libc::CPU_SETSIZE
            ));
        }
        for c in first..=last {
            if !cpus.contains(&c) {
                cpus.push(c);
            }
        }
    }
    Ok(cpus)
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
    fn lists_take_numbers_and_ranges() {
        assert_eq!(parse_list("0-1"), Ok(vec![0, 1]));
        assert_eq!(parse_list("3,0-2,8"), Ok(vec![3, 0, 1, 2, 8]));
        assert_eq!(parse_list(" 2 , 2-3 "), Ok(vec![2, 3]));
        assert_eq!(parse_list(""), Ok(vec![]));
        for bad in ["a", "1-", "-1", "3-1", "1,,2", "0-99999"] {
            assert!(parse_list(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ranges_are_compact() {
        assert_eq!(ranges(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(ranges(&[5]), "5");
    }
}
