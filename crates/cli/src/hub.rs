//! Models named by a Hugging Face id (`--model owner/name[@revision]`): resolves the id to a snapshot
//! directory of the standard Hugging Face cache, downloading (resumably, with a progress bar) only the
//! files the server reads. Honours `HF_ENDPOINT`, `HF_HOME`, `HF_HUB_CACHE`, `HF_TOKEN` and
//! `HF_HUB_OFFLINE` as the Hugging Face tools do.

use std::collections::{BTreeSet, HashMap};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex};

use anyhow::{Result, anyhow, bail};
use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};

const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
const CONFIG: &str = "config.json";
const INDEX: &str = "model.safetensors.index.json";
/// Read when the repository has them: generation defaults, tokenizer, chat template, processor config.
const OPTIONAL: [&str; 7] = [
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "special_tokens_map.json",
];

/// What a command reads of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Need {
    /// Everything the server loads: config, safetensors weights, tokenizer, chat template.
    Model,
    /// `config.json` alone (`plan`, `kernels check`).
    Config,
    /// Everything but the weights: config, tokenizer, chat template (what `serve` checks before the
    /// weights download).
    Text,
}

/// A Hugging Face model id and the revision (branch, tag or commit) to fetch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubId {
    pub repo: String,
    pub revision: String,
}

impl std::fmt::Display for HubId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.revision.as_str() {
            "main" => write!(f, "{}", self.repo),
            rev => write!(f, "{}@{rev}", self.repo),
        }
    }
}

impl HubId {
    /// `owner/name` or `owner/name@revision` (the Hub's rules for names: letters, digits, `-`, `_`,
    /// `.`; no `--` or `..`; not starting or ending with `-` or `.`); None for anything else.
    pub fn parse(value: &str) -> Option<Self> {
        let (repo, revision) = match value.split_once('@') {
            Some((repo, rev)) if !rev.is_empty() && !rev.contains(char::is_whitespace) => (repo, rev),
            Some(_) => return None,
            None => (value, "main"),
        };
        let (owner, name) = repo.split_once('/')?;
        let part_ok = |p: &str| {
            !p.is_empty()
                && p.len() <= 96
                && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
                && !p.starts_with(['-', '.'])
                && !p.ends_with(['-', '.'])
                && !p.contains("--")
                && !p.contains("..")
        };
        (part_ok(owner) && part_ok(name)).then(|| Self { repo: repo.to_string(), revision: revision.to_string() })
    }
}

/// The Hub id `--model VALUE` names: None when VALUE exists as a local path (always a path) or is not
/// shaped like an id.
pub fn hub_id(value: &Path) -> Option<HubId> {
    if value.exists() {
        return None;
    }
    HubId::parse(value.to_str()?)
}

/// The model name a server answers to by default: the repository id for a Hub id (as clients of other
/// servers send it), else the directory's name.
pub fn served_name(value: &Path) -> String {
    match hub_id(value) {
        Some(id) => id.repo,
        None => value.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned()),
    }
}

/// The directory `--model VALUE` names: VALUE itself unless it is a Hub id (a path that does not exist
/// is left to the loader's "does not exist" error), else the id's snapshot in the Hugging Face cache,
/// holding the files `need` reads (downloaded first where missing; once per process).
pub fn resolve(value: &Path, need: Need) -> Result<PathBuf> {
    static RESOLVED: LazyLock<Mutex<HashMap<(PathBuf, Need), PathBuf>>> = LazyLock::new(Default::default);
    let Some(id) = hub_id(value) else {
        return Ok(value.to_path_buf());
    };
    let key = (value.to_path_buf(), need);
    if let Some(dir) = RESOLVED.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(dir.clone());
    }
    let hub = Hub::from_env(|k| std::env::var(k).ok());
    let dir = if hub.offline { hub.cached(&id, need)? } else { hub.fetch(&id, need)? };
    RESOLVED.lock().unwrap_or_else(|e| e.into_inner()).insert(key, dir.clone());
    Ok(dir)
}

/// Whether `dir` (a Hub snapshot) holds safetensors weights, not only a config.
pub fn has_weights(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .is_ok_and(|rd| rd.flatten().any(|e| e.path().extension().is_some_and(|x| x == "safetensors")))
}

/// The Hub's address, the cache and the credentials, from the environment.
#[derive(Debug, PartialEq)]
struct Hub {
    endpoint: String,
    /// The hub cache (`…/huggingface/hub`), holding `models--owner--name/{blobs,refs,snapshots}`.
    cache: PathBuf,
    token: Option<String>,
    offline: bool,
}

/// One repository file the Hub lists (top-level files only: the server reads no sub-folder).
#[derive(serde::Deserialize)]
struct Sibling {
    rfilename: String,
    size: Option<u64>,
}

/// The Hub's answer to `/api/models/{repo}/revision/{rev}?blobs=true`.
#[derive(serde::Deserialize)]
struct RepoFiles {
    sha: String,
    siblings: Vec<Sibling>,
}

impl Hub {
    /// The settings the Hugging Face tools read: `HF_ENDPOINT`; `HF_HUB_CACHE`, else `HF_HOME/hub`
    /// (`HF_HOME`: else `XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`); `HF_TOKEN`, else the
    /// token file (`HF_TOKEN_PATH`, else `HF_HOME/token`) that `hf auth login` writes; `HF_HUB_OFFLINE`.
    fn from_env(var: impl Fn(&str) -> Option<String>) -> Self {
        let var = |k: &str| var(k).filter(|v| !v.trim().is_empty());
        let home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            var("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| var("HOME").map(|h| Path::new(&h).join(".cache")))
                .unwrap_or_else(std::env::temp_dir)
                .join("huggingface")
        });
        let cache = var("HF_HUB_CACHE")
            .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
            .map_or_else(|| home.join("hub"), PathBuf::from);
        let token_file = var("HF_TOKEN_PATH").map_or_else(|| home.join("token"), PathBuf::from);
        let token = var("HF_TOKEN")
            .or_else(|| std::fs::read_to_string(token_file).ok())
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty());
        let offline = var("HF_HUB_OFFLINE")
            .is_some_and(|v| ["1", "on", "yes", "true"].contains(&v.trim().to_ascii_lowercase().as_str()));
        let endpoint = var("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.into()).trim_end_matches('/').to_string();
        Self { endpoint, cache, token, offline }
    }

    fn repo_dir(&self, id: &HubId) -> PathBuf {
        self.cache.join(format!("models--{}", id.repo.replace('/', "--")))
    }

    /// Online: lists the repository at the revision, then downloads what `need` reads and the snapshot
    /// lacks (metadata first, then the weights the index names).
    fn fetch(&self, id: &HubId, need: Need) -> Result<PathBuf> {
        let api = ApiBuilder::from_cache(Cache::new(self.cache.clone()))
            .with_endpoint(self.endpoint.clone())
            .with_token(self.token.clone())
            .with_progress(false)
            .with_retries(3)
            .with_user_agent("deltaserve", env!("CARGO_PKG_VERSION"))
            .build()
            .map_err(|e| anyhow!("the Hugging Face Hub client: {e}"))?;
        let repo = api.repo(Repo::with_revision(id.repo.clone(), RepoType::Model, id.revision.clone()));
        let listing: RepoFiles = match repo.info_request().query("blobs", "true").call() {
            Ok(response) => {
                response.into_json().map_err(|e| anyhow!("`{id}`: unreadable file list from {}: {e}", self.endpoint))?
            }
            // No network: a complete cached copy of the revision serves, as with HF_HUB_OFFLINE.
            Err(ureq::Error::Transport(t)) => {
                let dir = self.cached(id, need).map_err(|_| self.request_error(id, ureq::Error::Transport(t)))?;
                tracing::warn!("cannot reach the Hugging Face Hub at {}: using the cached copy of {id}", self.endpoint);
                return Ok(dir);
            }
            Err(e) => return Err(self.request_error(id, e)),
        };
        if listing.sha.is_empty() || !listing.sha.chars().all(|c| c.is_ascii_alphanumeric()) {
            bail!("`{id}`: the Hub at {} answered a malformed commit `{}`", self.endpoint, listing.sha);
        }
        let sizes: HashMap<&str, Option<u64>> = listing
            .siblings
            .iter()
            .filter(|s| !s.rfilename.contains('/'))
            .map(|s| (s.rfilename.as_str(), s.size))
            .collect();
        let listed: BTreeSet<&str> = sizes.keys().copied().collect();
        let snapshot = self.repo_dir(id).join("snapshots").join(&listing.sha);
        if !listed.contains(CONFIG) {
            bail!("`{id}` has no {CONFIG}: not a Transformers model repository");
        }
        let fetch = Fetch { hub: self, id, repo: &repo, snapshot: &snapshot, sizes: &sizes };
        fetch.files(&metadata_files(&listed, need))?;
        if need == Need::Model {
            let shards =
                weight_files(&listed, read_index(&snapshot)?.as_deref()).map_err(|e| anyhow!("`{id}`: {e}"))?;
            if let Some(absent) = shards.iter().find(|s| !listed.contains(s.as_str())) {
                bail!("`{id}`: {INDEX} names {absent}, which the repository does not have");
            }
            fetch.files(&shards)?;
        }
        Ok(snapshot)
    }

    /// Offline (`HF_HUB_OFFLINE`): the snapshot the revision points to, which must hold what `need` reads.
    fn cached(&self, id: &HubId, need: Need) -> Result<PathBuf> {
        let repo_dir = self.repo_dir(id);
        let commit = std::fs::read_to_string(repo_dir.join("refs").join(&id.revision))
            .map(|c| c.trim().to_string())
            .unwrap_or_else(|_| id.revision.clone());
        let snapshot = repo_dir.join("snapshots").join(&commit);
        let run_online = "run once without HF_HUB_OFFLINE to download it";
        if !snapshot.join(CONFIG).exists() {
            bail!(
                "HF_HUB_OFFLINE is set and `{id}` is not in the Hugging Face cache ({}): {run_online}",
                self.cache.display()
            );
        }
        if need != Need::Model {
            return Ok(snapshot);
        }
        let listed: Vec<String> = std::fs::read_dir(&snapshot)
            .map_err(|e| anyhow!("reading {}: {e}", snapshot.display()))?
            .flatten()
            .filter(|e| e.path().exists())
            .filter_map(|e| e.file_name().to_str().map(String::from))
            .collect();
        let listed: BTreeSet<&str> = listed.iter().map(String::as_str).collect();
        let missing: Vec<String> = match weight_files(&listed, read_index(&snapshot)?.as_deref()) {
            Ok(shards) => shards.into_iter().filter(|s| !snapshot.join(s).exists()).collect(),
            Err(_) => vec!["its *.safetensors weights".into()],
        };
        if !missing.is_empty() {
            bail!("HF_HUB_OFFLINE is set and the cached copy of `{id}` lacks {}: {run_online}", missing.join(", "));
        }
        Ok(snapshot)
    }

    /// A one-line error for a failed Hub request, naming the cause a user can act on.
    fn request_error(&self, id: &HubId, e: ureq::Error) -> anyhow::Error {
        let (code, kind) = match e {
            ureq::Error::Status(code, resp) => (code, resp.header("x-error-code").unwrap_or_default().to_string()),
            ureq::Error::Transport(t) => {
                let why = t.to_string().replace('\n', " ");
                return anyhow!(
                    "cannot reach the Hugging Face Hub at {} for `{id}` ({why}), and the Hugging Face cache ({}) has \
                     no complete copy of it",
                    self.endpoint,
                    self.cache.display()
                );
            }
        };
        let token_hint = match &self.token {
            Some(_) => "HF_TOKEN's account has no access to it",
            None => "set HF_TOKEN to a token with access",
        };
        let endpoint = &self.endpoint;
        match (code, kind.as_str()) {
            (_, "GatedRepo") => {
                anyhow!(
                    "`{id}` is a gated model (HTTP {code}): accept its terms at {endpoint}/{} and {token_hint}",
                    id.repo
                )
            }
            (_, "RevisionNotFound") => {
                anyhow!("`{}` has no revision `{}` on the Hugging Face Hub (HTTP {code})", id.repo, id.revision)
            }
            (404, _) | (_, "RepoNotFound") => anyhow!(
                "`{id}` is neither a local directory nor a model on the Hugging Face Hub at {endpoint} (HTTP {code}); \
                 if it is private, {token_hint}"
            ),
            (401 | 403, _) => {
                anyhow!(
                    "the Hugging Face Hub refused access to `{id}` (HTTP {code}): it is gated or private; {token_hint}"
                )
            }
            _ => anyhow!("the Hugging Face Hub at {endpoint} answered HTTP {code} for `{id}`"),
        }
    }
}

/// Downloads into one snapshot of one repository.
struct Fetch<'a> {
    hub: &'a Hub,
    id: &'a HubId,
    repo: &'a ApiRepo,
    snapshot: &'a Path,
    sizes: &'a HashMap<&'a str, Option<u64>>,
}

impl Fetch<'_> {
    /// Downloads those of `names` the snapshot lacks (hf-hub writes each to `blobs/ETAG.part`, resumed
    /// from where it stopped, and links it into the snapshot once complete).
    fn files(&self, names: &[String]) -> Result<()> {
        let missing: Vec<&String> = names.iter().filter(|n| !self.snapshot.join(n).exists()).collect();
        if missing.is_empty() {
            tracing::debug!(model = %self.id, "{} files in the Hugging Face cache", names.len());
            return Ok(());
        }
        let bytes: u64 = missing.iter().filter_map(|n| self.sizes.get(n.as_str()).copied().flatten()).sum();
        tracing::info!(
            "downloading {} file(s) of {} ({}) from {} into {}",
            missing.len(),
            self.id,
            deltaserve_plan::fmt_bytes(bytes),
            self.hub.endpoint,
            self.hub.cache.display()
        );
        for (i, name) in missing.iter().enumerate() {
            let progress = Progress::new(format!("[{}/{}] {name}", i + 1, missing.len()));
            let path = self.repo.download_with_progress(name, progress).map_err(|e| self.download_error(name, e))?;
            if path != self.snapshot.join(name) {
                bail!("`{}` changed on the Hub during the download: run again", self.id);
            }
            let got = std::fs::metadata(&path)?.len();
            if let Some(want) = self.sizes.get(name.as_str()).copied().flatten()
                && got != want
            {
                bail!("`{}`: {name} downloaded {got} bytes, the Hub lists {want}: run again", self.id);
            }
        }
        Ok(())
    }

    fn download_error(&self, name: &str, e: ApiError) -> anyhow::Error {
        match e {
            ApiError::RequestError(e) => self.hub.request_error(self.id, *e),
            ApiError::TooManyRetries(e) => self.download_error(name, *e),
            ApiError::LockAcquisition(lock) => {
                anyhow!("another process is downloading {name} of `{}` (it holds {})", self.id, lock.display())
            }
            e => anyhow!("downloading {name} of `{}` into {}: {e}", self.id, self.hub.cache.display()),
        }
    }
}

/// The non-weight files `need` reads, of those the repository lists.
fn metadata_files(listed: &BTreeSet<&str>, need: Need) -> Vec<String> {
    let mut wanted = vec![CONFIG];
    if need != Need::Config {
        wanted.push(INDEX);
        wanted.extend(OPTIONAL);
    }
    wanted.into_iter().filter(|f| listed.contains(f)).map(String::from).collect()
}

/// The safetensors files the checkpoint loader opens: the shards `index` (the text of
/// `model.safetensors.index.json`) names, else `model.safetensors`, else every listed `*.safetensors`.
fn weight_files(listed: &BTreeSet<&str>, index: Option<&str>) -> Result<Vec<String>, String> {
    let files: Vec<String> = match index {
        Some(text) => {
            let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("{INDEX}: invalid JSON: {e}"))?;
            let map =
                v.get("weight_map").and_then(|m| m.as_object()).ok_or(format!("{INDEX}: no `weight_map` object"))?;
            let mut shards = BTreeSet::new();
            for file in map.values() {
                match file.as_str() {
                    Some(f) if !f.is_empty() && !f.contains(['/', '\\']) && !f.contains("..") => {
                        shards.insert(f.to_string())
                    }
                    _ => return Err(format!("{INDEX}: weight_map has {file}, not a plain file name")),
                };
            }
            shards.into_iter().collect()
        }
        None if listed.contains("model.safetensors") => vec!["model.safetensors".into()],
        None => listed.iter().filter(|f| f.ends_with(".safetensors")).map(|f| f.to_string()).collect(),
    };
    if files.is_empty() {
        return Err("no *.safetensors weights (deltaserve loads safetensors checkpoints)".into());
    }
    Ok(files)
}

/// The snapshot's `model.safetensors.index.json`, when it has one.
fn read_index(snapshot: &Path) -> Result<Option<String>> {
    let path = snapshot.join(INDEX);
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(anyhow!("reading {}: {e}", path.display())),
    }
}

/// One file's download progress: a bar on a terminal, else log lines when it starts (or resumes) and ends
/// (for files of [`Progress::LOGGED`] bytes or more; the smaller ones are in the batch's line).
struct Progress {
    label: String,
    bar: Option<indicatif::ProgressBar>,
    started: bool,
    logged: bool,
    /// The next `update` carries the bytes already on disk (hf-hub reports them after each `init`).
    expect_offset: bool,
}

impl Progress {
    const LOGGED: usize = 16 << 20;

    fn new(label: String) -> Self {
        Self { label, bar: None, started: false, logged: false, expect_offset: false }
    }
}

impl hf_hub::api::Progress for Progress {
    fn init(&mut self, size: usize, _filename: &str) {
        if !self.started {
            self.started = true;
            if std::io::stderr().is_terminal() {
                let bar = indicatif::ProgressBar::new(size as u64).with_message(self.label.clone());
                if let Ok(style) = indicatif::ProgressStyle::with_template(
                    "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ({eta})",
                ) {
                    bar.set_style(style.progress_chars("=> "));
                }
                self.bar = Some(bar);
            } else if size >= Self::LOGGED {
                self.logged = true;
                tracing::info!("downloading {} ({})", self.label, deltaserve_plan::fmt_bytes(size as u64));
            }
        }
        if let Some(bar) = &self.bar {
            bar.set_position(0);
        }
        self.expect_offset = true;
    }

    fn update(&mut self, size: usize) {
        if std::mem::take(&mut self.expect_offset) && size > 0 && self.logged {
            tracing::info!("resuming {} after {}", self.label, deltaserve_plan::fmt_bytes(size as u64));
        }
        if let Some(bar) = &self.bar {
            bar.inc(size as u64);
        }
    }

    fn finish(&mut self) {
        match &self.bar {
            Some(bar) => bar.finish(),
            None if self.logged => tracing::info!("downloaded {}", self.label),
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_follow_the_hubs_naming_rules() {
        let id = HubId::parse("Qwen/Qwen3.6-27B").unwrap();
        assert_eq!((id.repo.as_str(), id.revision.as_str()), ("Qwen/Qwen3.6-27B", "main"));
        let id = HubId::parse("org/model_v1.5@refs/pr/3").unwrap();
        assert_eq!((id.repo.as_str(), id.revision.as_str()), ("org/model_v1.5", "refs/pr/3"));
        assert_eq!(id.to_string(), "org/model_v1.5@refs/pr/3");
        for bad in [
            "gpt2", "/abs/dir", "./a/b", "a/b/c", "a/", "/b", "a/b@", "a--b/c", "a/b..c", "-a/b", "a/b.", "a b/c",
            "~/m",
        ] {
            assert_eq!(HubId::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn an_existing_path_is_never_an_id() {
        let dir = std::env::temp_dir().join(format!("ds-hub-unit-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("org/model")).unwrap();
        let cwd_relative = Path::new("org/model");
        assert!(hub_id(cwd_relative).is_some());
        assert_eq!(hub_id(&dir.join("org/model")), None);
        assert_eq!(served_name(&dir.join("org/model")), "model");
        assert_eq!(served_name(Path::new("Qwen/Qwen3.6-27B@v1")), "Qwen/Qwen3.6-27B");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn environment_like_the_hugging_face_tools() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            Hub::from_env(move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()))
        };
        let h = env(&[("HOME", "/home/u")]);
        assert_eq!(h.cache, Path::new("/home/u/.cache/huggingface/hub"));
        assert_eq!((h.endpoint.as_str(), h.offline, h.token.as_deref()), (DEFAULT_ENDPOINT, false, None));
        let h =
            env(&[("HF_HOME", "/hf"), ("HF_TOKEN", " hf_x "), ("HF_HUB_OFFLINE", "1"), ("HF_ENDPOINT", "http://m/")]);
        assert_eq!(h.cache, Path::new("/hf/hub"));
        assert_eq!((h.endpoint.as_str(), h.offline, h.token.as_deref()), ("http://m", true, Some("hf_x")));
        let h = env(&[("HF_HOME", "/hf"), ("HF_HUB_CACHE", "/c"), ("HF_HUB_OFFLINE", "0")]);
        assert_eq!((h.cache.as_path(), h.offline), (Path::new("/c"), false));
        assert_eq!(env(&[("XDG_CACHE_HOME", "/x")]).cache, Path::new("/x/huggingface/hub"));
        assert!(env(&[("HF_HUB_OFFLINE", "True")]).offline);
    }

    #[test]
    fn picks_only_what_the_server_reads() {
        let listed: BTreeSet<&str> = [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "consolidated.safetensors",
            "pytorch_model.bin",
            "README.md",
            ".gitattributes",
        ]
        .into();
        assert_eq!(metadata_files(&listed, Need::Config), ["config.json"]);
        assert_eq!(metadata_files(&listed, Need::Text), metadata_files(&listed, Need::Model));
        let meta = metadata_files(&listed, Need::Model);
        assert_eq!(
            meta,
            [
                "config.json",
                "model.safetensors.index.json",
                "generation_config.json",
                "tokenizer.json",
                "tokenizer_config.json",
                "chat_template.jinja"
            ]
        );
        let index = r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                        "c": "model-00001-of-00002.safetensors"}}"#;
        assert_eq!(
            weight_files(&listed, Some(index)).unwrap(),
            ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        );
        let single: BTreeSet<&str> = ["config.json", "model.safetensors", "other.safetensors"].into();
        assert_eq!(weight_files(&single, None).unwrap(), ["model.safetensors"]);
        let unnamed: BTreeSet<&str> = ["config.json", "b.safetensors", "a.safetensors"].into();
        assert_eq!(weight_files(&unnamed, None).unwrap(), ["a.safetensors", "b.safetensors"]);
        let none: BTreeSet<&str> = ["config.json", "pytorch_model.bin"].into();
        assert!(weight_files(&none, None).unwrap_err().contains("no *.safetensors"));
        let escape = r#"{"weight_map": {"a": "../../etc/passwd"}}"#;
        assert!(weight_files(&listed, Some(escape)).unwrap_err().contains("not a plain file name"));
    }
}
