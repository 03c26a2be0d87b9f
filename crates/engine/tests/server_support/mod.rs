//! A served tiny model on 127.0.0.1:0 and a minimal HTTP/1.1 client (raw TCP, `Connection:
//! close`, chunked bodies decoded) for the server and remote-backend tests.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;
use sluice_core::PolicyVersion;
use sluice_engine::server::{ServerOptions, ServerState, WeightEvents, serve};
use sluice_engine::{NativeEngine, NativeEngineParams};
use sluice_model::candle::{DType, Device, Tensor};
use sluice_model::names;
use sluice_model::presets::{Preset, preset_config, random_snapshot, write_preset};
use sluice_model::{
    LoadOptions, ModelConfig, ModelWeights, SaveOptions, Tokenizer, load_checkpoint,
    save_checkpoint,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// A running server; dropping it stops the server and the engine.
pub struct Served {
    pub addr: std::net::SocketAddr,
    pub dir: tempfile::TempDir,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    pub engine: NativeEngine,
}

impl Served {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn model_dir(&self) -> PathBuf {
        self.dir.path().join("model")
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            t.await.unwrap().unwrap();
        }
    }
}

/// Writes the tiny preset (seed 0) and serves it as model `tiny`.
pub async fn serve_tiny() -> Served {
    let dir = tempfile::tempdir().unwrap();
    write_preset(Preset::Tiny, &dir.path().join("model"), 0).unwrap();
    serve_dir(dir).await
}

/// Serves a model that, greedily, answers every chat with exactly `pieces` and then
/// `<|im_end|>`. Each piece becomes one token (added to the preset tokenizer when it is not one
/// already), and the weights are a bigram model: attention and MLP write nothing to the
/// residual stream, so the logits depend on the last token only, and an untied head maps each
/// token of the chain `\n` (the end of the generation prompt), pieces…, `<|im_end|>` to the next.
pub async fn serve_scripted(pieces: &[&str]) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    write_preset(Preset::Tiny, &model, 0).unwrap();
    let base = preset_config(Preset::Tiny);
    let path = model.join("tokenizer.json");
    let mut doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let added = doc["added_tokens"].as_array_mut().unwrap();
    let mut vocab = base.vocab_size;
    for p in pieces {
        let known = p.chars().count() == 1 || added.iter().any(|t| t["content"] == *p);
        if !known {
            added.push(serde_json::json!({
                "id": vocab, "content": p, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": false,
            }));
            vocab += 1;
        }
    }
    std::fs::write(&path, doc.to_string()).unwrap();
    let tokenizer = Tokenizer::from_dir(&model).unwrap();
    let chain: Vec<u32> = std::iter::once("\n")
        .chain(pieces.iter().copied())
        .chain(std::iter::once("<|im_end|>"))
        .map(|p| {
            let ids = tokenizer.encode(p, false).unwrap();
            assert_eq!(ids.len(), 1, "{p:?} is not one token: {ids:?}");
            ids[0]
        })
        .collect();
    let config = Arc::new(ModelConfig {
        vocab_size: vocab,
        tie_word_embeddings: false,
        ..base
    });
    let random = random_snapshot(Arc::clone(&config), 0, DType::F32, &Device::Cpu).unwrap();
    let mut tensors: HashMap<String, Tensor> = random
        .iter()
        .map(|(n, t)| (n.to_owned(), t.clone()))
        .collect();
    for (name, t) in tensors.iter_mut() {
        if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
            *t = t.zeros_like().unwrap();
        }
    }
    // Row `b` of the head is the normalized embedding of every token whose successor is `b`.
    let embed = tensors[names::EMBED].to_vec2::<f32>().unwrap();
    let hidden = config.hidden_size;
    let mut head = vec![0f32; vocab * hidden];
    for pair in chain.windows(2) {
        let e = &embed[pair[0] as usize];
        let rms = (e.iter().map(|x| x * x).sum::<f32>() / hidden as f32).sqrt();
        let row = &mut head[pair[1] as usize * hidden..][..hidden];
        for (h, x) in row.iter_mut().zip(e) {
            *h += x / rms;
        }
    }
    tensors.insert(
        names::LM_HEAD.into(),
        Tensor::from_vec(head, (vocab, hidden), &Device::Cpu).unwrap(),
    );
    let snapshot = ModelWeights::new(config, PolicyVersion(0), tensors).unwrap();
    save_checkpoint(&snapshot, &model, &SaveOptions::default()).unwrap();
    serve_dir(dir).await
}

/// [`serve_tiny`] on `addr` (a server coming back where it was).
pub async fn serve_tiny_at(addr: std::net::SocketAddr) -> Served {
    let dir = tempfile::tempdir().unwrap();
    write_preset(Preset::Tiny, &dir.path().join("model"), 0).unwrap();
    serve_dir_at(dir, addr).await
}

/// [`serve_tiny`] with a bearer token on the guarded routes and the HTTP server's options.
pub async fn serve_tiny_with(token: Option<&str>, http: sluice_http::ServeOptions) -> Served {
    let dir = tempfile::tempdir().unwrap();
    write_preset(Preset::Tiny, &dir.path().join("model"), 0).unwrap();
    let guard = Guard {
        token: token.map(sluice_core::config::Secret::new),
        http,
    };
    serve_dir_guarded(dir, "127.0.0.1:0".parse().unwrap(), guard).await
}

/// The token and HTTP options a test server runs with.
#[derive(Default)]
struct Guard {
    token: Option<sluice_core::config::Secret>,
    http: sluice_http::ServeOptions,
}

/// Serves `dir/model` as model `tiny`.
async fn serve_dir(dir: tempfile::TempDir) -> Served {
    serve_dir_at(dir, "127.0.0.1:0".parse().unwrap()).await
}

/// Serves `dir/model` as model `tiny` on `addr`.
async fn serve_dir_at(dir: tempfile::TempDir, addr: std::net::SocketAddr) -> Served {
    serve_dir_guarded(dir, addr, Guard::default()).await
}

/// Serves `dir/model` as model `tiny` on `addr` with `guard`.
async fn serve_dir_guarded(
    dir: tempfile::TempDir,
    addr: std::net::SocketAddr,
    guard: Guard,
) -> Served {
    let model = dir.path().join("model");
    let weights = Arc::new(load_checkpoint(&model, &LoadOptions::default()).unwrap());
    let tokenizer = Arc::new(Tokenizer::from_dir(&model).unwrap());
    let events = Arc::new(WeightEvents::default());
    let params = NativeEngineParams {
        max_running_sequences: 8,
        max_step_tokens: 512,
        eos_token_ids: tokenizer.eos_token_ids().to_vec(),
        ..NativeEngineParams::default()
    };
    let engine = NativeEngine::start(
        params,
        Arc::clone(&weights),
        Some(Arc::clone(&tokenizer)),
        events.sink(),
    )
    .unwrap();
    let state = ServerState::new(
        engine.control(),
        tokenizer,
        ServerOptions {
            model_name: "tiny".into(),
            dtype: weights.dtype(),
            device: weights.device().clone(),
            max_n: 8,
            max_queued_sequences: 16,
            token: guard.token,
            http: guard.http,
        },
        events,
    );
    let listener = TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, state, async move {
        let _ = rx.await;
    }));
    Served {
        addr,
        dir,
        stop: Some(tx),
        task: Some(task),
        engine,
    }
}

/// Writes the tiny preset with `seed` into `dir` (weights for `update_weights_from_disk`).
pub fn write_tiny(dir: &Path, seed: u64) {
    write_preset(Preset::Tiny, dir, seed).unwrap();
}

/// A reply: status and body (chunked encoding removed).
pub struct Reply {
    pub status: u16,
    /// The status line and headers, lowercased.
    pub head: String,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// The `data:` payloads of a server-sent-events body.
    pub fn events(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.trim_start().to_owned())
            .collect()
    }
}

/// One request over a fresh connection.
pub async fn call(addr: std::net::SocketAddr, method: &str, path: &str, body: &str) -> Reply {
    call_with(addr, method, path, body, "").await
}

/// [`call`] with extra header lines (`"authorization: Bearer x\r\n"`).
pub async fn call_with(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: &str,
    headers: &str,
) -> Reply {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{headers}connection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_owned()
    };
    Reply {
        status,
        head: head.to_ascii_lowercase(),
        body,
    }
}

pub async fn post(addr: std::net::SocketAddr, path: &str, body: Value) -> Reply {
    call(addr, "POST", path, &body.to_string()).await
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}
