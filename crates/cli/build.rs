//! Build script: stamps the binary with the git commit it was built from (`deltaserve --version`).

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !s.is_empty()).then_some(s)
}

fn main() {
    // An explicit commit (a build outside a git checkout, e.g. a container build) wins.
    println!("cargo:rerun-if-env-changed=DELTASERVE_GIT_COMMIT");
    let commit = std::env::var("DELTASERVE_GIT_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| git(&["rev-parse", "--short", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=DELTASERVE_GIT_COMMIT={commit}");
    // Rebuild when HEAD moves: HEAD itself (a checkout) and the branch it points to (a commit).
    for p in ["HEAD", "packed-refs"].into_iter().filter_map(|f| git(&["rev-parse", "--git-path", f])) {
        println!("cargo:rerun-if-changed={p}");
    }
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"])
        && let Some(p) = git(&["rev-parse", "--git-path", &branch])
    {
        println!("cargo:rerun-if-changed={p}");
    }
}
