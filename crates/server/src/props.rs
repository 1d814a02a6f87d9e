//! `GET /props`: the server's settings in the shape llama.cpp's server reports them, for clients that
//! read the context size, the slots or the chat template from there (`default_generation_settings.n_ctx`,
//! `total_slots`, `chat_template`, `modalities`).

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::state::AppState;

pub async fn props(State(st): State<AppState>) -> Response {
    let sched = st.engine.sched_config();
    let d = &st.sampling_defaults;
    let template = st.template.as_deref();
    let body = json!({
        "default_generation_settings": {
            "n_ctx": sched.max_context,
            "params": {
                "temperature": d.temperature,
                "top_k": d.top_k,
                "top_p": d.top_p,
                "min_p": d.min_p,
                "repeat_penalty": d.repetition_penalty,
                "presence_penalty": d.presence_penalty,
                "frequency_penalty": d.frequency_penalty,
                "n_predict": -1,
            },
        },
        "total_slots": sched.max_seqs,
        "model_path": st.cfg.served_model_name,
        "modalities": {"vision": st.engine.runs_images(), "audio": false},
        "chat_template": template.map(|t| t.source()),
        "bos_token": template.and_then(|t| t.special_token("bos_token")),
        "eos_token": template.and_then(|t| t.special_token("eos_token")),
        "build_info": format!("deltaserve {}", env!("CARGO_PKG_VERSION")),
    });
    st.metrics.request("props", 200);
    axum::Json(body).into_response()
}
