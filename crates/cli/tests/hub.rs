//! `--model owner/name` against a fake Hugging Face Hub on 127.0.0.1 (`HF_ENDPOINT`), with the cache in a
//! temporary `HF_HOME`: only the files the server reads are downloaded, a second run is a cache hit,
//! `HF_HUB_OFFLINE=1` runs from the cache, a partial download resumes, `plan` fetches the config alone,
//! and unknown, gated or unreachable ids are one-line errors.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex, OnceLock};

use common::tempdir;

const SHA: &str = "0123456789abcdef0123456789abcdef01234567";
const SHARD: &str = "model-00001-of-00001.safetensors";

/// A repository the fake hub serves: file name → bytes.
type Files = BTreeMap<String, Vec<u8>>;

/// One request the fake hub answered: path and `Range` header.
#[derive(Clone, Debug)]
struct Req {
    path: String,
    range: Option<String>,
}

/// The Hub's HTTP layout on a loopback port: `/api/models/{repo}/revision/{rev}` (the file list) and
/// `/{repo}/resolve/{rev}/{file}` (the bytes, with `ETag`, `X-Repo-Commit` and range support).
struct FakeHub {
    url: String,
    log: Arc<Mutex<Vec<Req>>>,
}

impl FakeHub {
    /// Serves `acme/tiny` (a synthetic model with an index, one shard and files the server never reads)
    /// and `acme/gated` (the same files behind a 401 GatedRepo); any other id is a 404 RepoNotFound.
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let log = Arc::new(Mutex::new(Vec::new()));
        let log2 = log.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let log = log2.clone();
                std::thread::spawn(move || answer(stream, &log));
            }
        });
        Self { url, log }
    }

    fn requests(&self) -> Vec<Req> {
        self.log.lock().unwrap().clone()
    }

    /// The files downloaded (`resolve` requests) so far.
    fn resolved(&self) -> BTreeSet<String> {
        self.requests().iter().filter_map(|r| r.path.split_once("/resolve/").map(|(_, f)| file_of(f))).collect()
    }

    fn clear(&self) {
        self.log.lock().unwrap().clear();
    }
}

fn file_of(rev_and_file: &str) -> String {
    rev_and_file.split_once('/').map_or(String::new(), |(_, f)| f.to_string())
}

/// The synthetic model's files in the Hub layout, made once per test process.
fn repo_files() -> &'static Files {
    static FILES: OnceLock<Files> = OnceLock::new();
    FILES.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ds-hub-model-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        deltaserve_text::synth_model::write_synthetic_model(
            &dir,
            deltaserve_model::synth::Preset::Tiny,
            None,
            5,
            |_, _| {},
        )
        .unwrap();
        let mut files = Files::new();
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            files.insert(e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap());
        }
        std::fs::remove_dir_all(&dir).unwrap();
        let weights = files.remove("model.safetensors").unwrap();
        let header_len = u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&weights[8..8 + header_len]).unwrap();
        let map: serde_json::Map<String, serde_json::Value> = header
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| *k != "__metadata__")
            .map(|k| (k.clone(), SHARD.into()))
            .collect();
        let index = serde_json::json!({"metadata": {"total_size": weights.len()}, "weight_map": map});
        files.insert("model.safetensors.index.json".into(), index.to_string().into_bytes());
        files.insert("consolidated.safetensors".into(), weights.clone());
        files.insert(SHARD.into(), weights);
        files.insert("README.md".into(), b"# tiny\n".to_vec());
        files.insert(".gitattributes".into(), b"*.safetensors filter=lfs\n".to_vec());
        files.insert("original/params.json".into(), b"{}".to_vec());
        files
    })
}

fn etag(name: &str) -> String {
    name.bytes().map(|b| format!("{b:02x}")).collect()
}

fn answer(mut stream: TcpStream, log: &Mutex<Vec<Req>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let mut range = None;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':')
            && k.eq_ignore_ascii_case("range")
        {
            range = Some(v.trim().to_string());
        }
    }
    log.lock().unwrap().push(Req { path: path.clone(), range: range.clone() });
    let files = repo_files();
    let known = |repo: &str| repo == "acme/tiny" || repo == "acme/gated";
    let (status, headers, body): (&str, Vec<(String, String)>, Vec<u8>) =
        if let Some(rest) = path.strip_prefix("/api/models/") {
            let repo = rest.split("/revision/").next().unwrap_or_default();
            if known(repo) {
                let siblings: Vec<_> =
                    files.iter().map(|(n, b)| serde_json::json!({"rfilename": n, "size": b.len()})).collect();
                let info = serde_json::json!({"id": repo, "sha": SHA, "siblings": siblings});
                ("200 OK", vec![("Content-Type".into(), "application/json".into())], info.to_string().into_bytes())
            } else {
                ("404 Not Found", vec![("X-Error-Code".into(), "RepoNotFound".into())], b"{}".to_vec())
            }
        } else {
            let (repo, rest) = path.trim_start_matches('/').split_once("/resolve/").unwrap_or_default();
            let name = file_of(rest);
            match (repo, files.get(&name)) {
                ("acme/gated", _) => ("401 Unauthorized", vec![("X-Error-Code".into(), "GatedRepo".into())], vec![]),
                ("acme/tiny", Some(bytes)) => {
                    let start = range
                        .as_deref()
                        .and_then(|r| r.strip_prefix("bytes="))
                        .and_then(|r| r.split('-').next())
                        .and_then(|s| s.parse::<usize>().ok());
                    let end = range
                        .as_deref()
                        .and_then(|r| r.split('-').nth(1))
                        .and_then(|s| s.parse::<usize>().ok())
                        .map_or(bytes.len(), |e| (e + 1).min(bytes.len()));
                    let mut headers = vec![
                        ("ETag".to_string(), format!("\"{}\"", etag(&name))),
                        ("X-Repo-Commit".to_string(), SHA.to_string()),
                        ("Accept-Ranges".to_string(), "bytes".to_string()),
                    ];
                    match start {
                        Some(s) => {
                            headers.push(("Content-Range".into(), format!("bytes {s}-{}/{}", end - 1, bytes.len())));
                            ("206 Partial Content", headers, bytes[s..end].to_vec())
                        }
                        None => ("200 OK", headers, bytes.clone()),
                    }
                }
                _ => ("404 Not Found", vec![("X-Error-Code".into(), "RepoNotFound".into())], vec![]),
            }
        };
    let mut head = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n", body.len());
    for (k, v) in headers {
        head += &format!("{k}: {v}\r\n");
    }
    head += "\r\n";
    let _ = stream.write_all(head.as_bytes()).and_then(|_| stream.write_all(&body));
}

/// `deltaserve ARGS` with the Hub at `endpoint` and the cache in `home` (nothing from the caller's
/// Hugging Face settings).
fn deltaserve(endpoint: &str, home: &Path, args: &[&str]) -> Command {
    let mut c = common::deltaserve();
    for k in ["HF_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"] {
        c.env_remove(k);
    }
    c.env("HF_ENDPOINT", endpoint).env("HF_HOME", home).args(args);
    c
}

fn generate(model: &str) -> Vec<&str> {
    vec![
        "generate",
        "--model",
        model,
        "--device",
        "cpu",
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
        "--temperature",
        "0",
        "--json",
    ]
}

fn ok(out: Output) -> Output {
    assert!(out.status.success(), "failed: {}", String::from_utf8_lossy(&out.stderr));
    out
}

/// A clean failure: non-zero exit and exactly one stderr line, `error: ...` with every needle.
fn one_line_error(out: Output, needles: &[&str]) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "expected a failure: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "want one line: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    for n in needles {
        assert!(stderr.contains(n), "stderr should mention `{n}`: {stderr}");
    }
    stderr
}

fn wanted() -> BTreeSet<String> {
    [
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
        SHARD,
    ]
    .map(String::from)
    .into()
}

#[test]
fn downloads_what_the_server_reads_then_runs_from_the_cache() {
    let (hub, home) = (FakeHub::start(), tempdir("hub", "flow"));
    let first = ok(deltaserve(&hub.url, &home, &generate("acme/tiny")).output().unwrap());
    let tokens = |out: &Output| serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["token_ids"].clone();
    assert_eq!(tokens(&first).as_array().unwrap().len(), 2);
    assert_eq!(hub.resolved(), wanted(), "{:?}", hub.requests());
    let snapshot = home.join("hub/models--acme--tiny/snapshots").join(SHA);
    let on_disk: BTreeSet<String> =
        std::fs::read_dir(&snapshot).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(on_disk, wanted());
    assert_eq!(std::fs::read(snapshot.join(SHARD)).unwrap(), repo_files()[SHARD]);
    assert_eq!(std::fs::read_to_string(home.join("hub/models--acme--tiny/refs/main")).unwrap(), SHA);

    // A second run lists the repository and downloads nothing.
    hub.clear();
    let second = ok(deltaserve(&hub.url, &home, &generate("acme/tiny")).output().unwrap());
    assert_eq!(tokens(&second), tokens(&first));
    assert!(hub.resolved().is_empty(), "{:?}", hub.requests());

    // Offline, with no Hub at all: the cache alone (serve's default name is the id).
    hub.clear();
    let nowhere = "http://127.0.0.1:9";
    let mut offline = deltaserve(nowhere, &home, &generate("acme/tiny"));
    ok(offline.env("HF_HUB_OFFLINE", "1").output().unwrap());
    let mut plan = deltaserve(nowhere, &home, &["plan", "--model", "acme/tiny", "--device", "cpu", "--json"]);
    ok(plan.env("HF_HUB_OFFLINE", "1").output().unwrap());
    assert!(hub.requests().is_empty(), "{:?}", hub.requests());
    // Online but with no network: the complete cached copy serves (with a warning).
    let out = ok(deltaserve(nowhere, &home, &generate("acme/tiny")).output().unwrap());
    assert!(String::from_utf8_lossy(&out.stderr).contains("using the cached copy"));
}

#[test]
fn plan_downloads_the_config_alone_and_offline_names_what_is_missing() {
    let (hub, home) = (FakeHub::start(), tempdir("hub", "plan"));
    let out = ok(deltaserve(&hub.url, &home, &["plan", "--model", "acme/tiny", "--memory", "1GiB", "--json"])
        .output()
        .unwrap());
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(j["max_context"].as_u64().unwrap() > 0, "{j}");
    assert_eq!(hub.resolved(), BTreeSet::from(["config.json".to_string()]), "{:?}", hub.requests());

    let mut offline = deltaserve(&hub.url, &home, &generate("acme/tiny"));
    one_line_error(offline.env("HF_HUB_OFFLINE", "1").output().unwrap(), &["HF_HUB_OFFLINE", "acme/tiny", "lacks"]);
    let mut other = deltaserve(&hub.url, &home, &generate("acme/other"));
    one_line_error(other.env("HF_HUB_OFFLINE", "1").output().unwrap(), &["not in the Hugging Face cache"]);
}

/// A transfer cut short leaves `blobs/ETAG.part`: it is not taken for the file (offline fails), and the
/// next run asks for the rest of the bytes only.
#[test]
fn a_partial_download_resumes() {
    let (hub, home) = (FakeHub::start(), tempdir("hub", "resume"));
    let blobs = home.join("hub/models--acme--tiny/blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    let weights = &repo_files()[SHARD];
    let half = weights.len() / 2;
    std::fs::write(blobs.join(format!("{}.part", etag(SHARD))), &weights[..half]).unwrap();
    let mut offline = deltaserve(&hub.url, &home, &generate("acme/tiny"));
    one_line_error(offline.env("HF_HUB_OFFLINE", "1").output().unwrap(), &["not in the Hugging Face cache"]);

    ok(deltaserve(&hub.url, &home, &generate("acme/tiny")).output().unwrap());
    let ranges: Vec<Option<String>> =
        hub.requests().into_iter().filter(|r| r.path.ends_with(SHARD)).map(|r| r.range).collect();
    assert_eq!(ranges, [Some("bytes=0-0".to_string()), Some(format!("bytes={half}-"))]);
    let snapshot = home.join("hub/models--acme--tiny/snapshots").join(SHA);
    assert_eq!(&std::fs::read(snapshot.join(SHARD)).unwrap(), weights);
}

#[test]
fn unknown_gated_and_unreachable_ids_are_one_line_errors() {
    let (hub, home) = (FakeHub::start(), tempdir("hub", "errors"));
    let out = deltaserve(&hub.url, &home, &generate("acme/nope")).output().unwrap();
    one_line_error(out, &["acme/nope", "neither a local directory nor a model on the Hugging Face Hub", "404"]);
    let out = deltaserve(&hub.url, &home, &generate("acme/gated")).output().unwrap();
    one_line_error(out, &["acme/gated", "gated", "HF_TOKEN"]);
    let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let out = deltaserve(&format!("http://{closed}"), &home, &generate("acme/tiny")).output().unwrap();
    one_line_error(out, &["cannot reach the Hugging Face Hub", "no complete copy"]);
    // Not shaped like an id, and no such directory: the loader's error, no request.
    let out = deltaserve(&hub.url, &home, &generate("no/such/dir")).output().unwrap();
    one_line_error(out, &["no/such/dir", "does not exist"]);
    assert!(hub.requests().iter().all(|r| !r.path.contains("no/such")), "{:?}", hub.requests());
}

/// A directory that exists is a path even when it reads like an id: no request goes to the Hub.
#[test]
fn an_existing_directory_wins_over_an_id() {
    let (hub, cwd) = (FakeHub::start(), tempdir("hub", "local"));
    let model = cwd.join("acme/tiny");
    std::fs::create_dir_all(&model).unwrap();
    for name in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::write(model.join(name), &repo_files()[name]).unwrap();
    }
    std::fs::write(model.join("model.safetensors"), &repo_files()[SHARD]).unwrap();
    ok(deltaserve(&hub.url, &cwd.join("hf"), &generate("acme/tiny")).current_dir(&cwd).output().unwrap());
    assert!(hub.requests().is_empty(), "{:?}", hub.requests());
}

/// `serve` checks what it can on the config and tokenizer (here: a memory budget the machine does not have)
/// before the weights download: the error comes with no shard requested.
#[test]
fn serve_checks_before_the_weights_download() {
    let (hub, home) = (FakeHub::start(), tempdir("hub", "serve-check"));
    let args = ["serve", "--model", "acme/tiny", "--device", "cpu", "--port", "0", "--memory", "100000GiB"];
    one_line_error(deltaserve(&hub.url, &home, &args).output().unwrap(), &["memory"]);
    let resolved = hub.resolved();
    assert!(resolved.contains("tokenizer.json"), "{:?}", hub.requests());
    assert!(!resolved.contains(SHARD), "{:?}", hub.requests());
}
