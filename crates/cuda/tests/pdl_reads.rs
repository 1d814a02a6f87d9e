//! The read rule of programmatically launched kernels (kernels/prelude.cuh, above `pdl_trigger`),
//! checked on the kernel sources without a GPU. A function that waits for the kernel before it
//! (`pdl_wait()` / `pdl_enter()`), and every helper it calls, runs while earlier kernels of the step
//! still write its inputs, so its `const T* __restrict__` parameters, from which the compiler may emit
//! the non-coherent `ld.global.nc`, may only be data that nothing writes during the step: weights and
//! step inputs uploaded before it. An H200 showed the failure this prevents: such a load of the
//! in-projection's z read the previous layer's values (bench/results/pdl-coherent-loads-h200-2026-11-30.md).
//! Every kernel launched with `launch_pdl!` must wait at all.

use deltaserve_cuda::nvrtc::SOURCES;

/// Parameter names that hold weights or step inputs in the kernels that wait.
const READ_ONLY: &[&str] = &[
    "w",
    "w0",
    "w1",
    "w2",
    "qw",
    "scales",
    "zeros",
    "nw",
    "A_log",
    "dt_bias",
    "wq",
    "wk",
    "slots",
    "ids",
    "pos",
    "rope_pos",
    "block_tables",
    "table_rows",
    "seq_lens",
    "groups",
    "cu_seqlens",
    "perm",
    // mixture-of-experts weights: the shared expert's gate, expert 0's int4 tensors, the bf16 experts, the
    // shared expert's bf16 projection run with them
    "wg",
    "qw0",
    "sc0",
    "z0",
    "W",
    "Ws",
    // block-FP8 weights' scales (the FP8 GEMV's segments)
    "S",
    "s0",
    "s1",
    "s2",
];

/// Local pointers into weights that the functions that wait read with `ld_nc` / `__ldg` (the bf16
/// GEMV's rows, the int4 GEMV's codes, scales and zeros, the int4 tile GEMM's next group's scales and
/// zeros, a bf16 expert's rows, the FP8 GEMV's rows).
const READ_ONLY_LOCALS: &[&str] = &["wp0", "wp1", "qw4", "ps", "pz", "ssrc", "zsrc", "We", "srow", "wp", "wrow"];

/// A function definition of a kernel source: its name, parameter list and body.
struct Function<'a> {
    name: &'a str,
    params: &'a str,
    body: &'a str,
}

/// The byte index just past the bracket that closes the one at `open` (`(` or `{`).
fn closing(s: &str, open: usize) -> Option<usize> {
    let (o, c) = match s.as_bytes()[open] {
        b'(' => (b'(', b')'),
        _ => (b'{', b'}'),
    };
    let mut depth = 0usize;
    for (i, &b) in s.as_bytes().iter().enumerate().skip(open) {
        if b == o {
            depth += 1;
        } else if b == c {
            depth -= 1;
            if depth == 0 {
                return Some(i + 1);
            }
        }
    }
    None
}

/// Every `__global__` / `__device__` function defined in `src` (a `__launch_bounds__(..)` before the
/// name is skipped; declarations without a body are not returned).
fn functions(src: &str) -> Vec<Function<'_>> {
    // The identifier that ends at byte `end`.
    let ident_before = |end: usize| {
        let start = src[..end].rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |q| q + 1);
        (start, &src[start..end])
    };
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(off) = src[at..].find("__global__").into_iter().chain(src[at..].find("__device__")).min() {
        // (both keywords are 10 bytes long)
        let mut i = at + off + "__global__".len();
        let (name_start, paren) = loop {
            let Some(p) = src[i..].find('(').map(|p| i + p) else { return out };
            match ident_before(p) {
                (_, "__launch_bounds__") => i = closing(src, p).unwrap_or(src.len()),
                (start, _) => break (start, p),
            }
        };
        let Some(close) = closing(src, paren) else { break };
        let rest = src[close..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
        if rest.starts_with('{') {
            let open = src.len() - rest.len();
            let end = closing(src, open).unwrap_or(src.len());
            out.push(Function {
                name: &src[name_start..paren],
                params: &src[paren + 1..close - 1],
                body: &src[open..end],
            });
            at = end;
        } else {
            at = close;
        }
    }
    out
}

/// The names of `params` declared `const T* __restrict__ name`.
fn const_restrict(params: &str) -> Vec<&str> {
    params
        .split(',')
        .filter(|p| p.contains("const") && p.contains('*') && p.contains("__restrict__"))
        .filter_map(|p| p.trim_end_matches(|c: char| c.is_whitespace() || c == '\\').rsplit([' ', '*']).next())
        .collect()
}

/// `t` without its leading opening parentheses and spaces.
fn open_parens(t: &str) -> &str {
    t.trim_start_matches(|c: char| c == '(' || c.is_whitespace())
}

/// The pointer each read-only load (`ld_nc(`, `ld_nc_stream(`, `__ldg(`) of `body` reads through: the
/// first identifier of its argument after any casts.
fn read_only_loads(body: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for call in ["ld_nc(", "ld_nc_stream(", "__ldg("] {
        for (i, _) in body.match_indices(call) {
            let open = i + call.len() - 1;
            let arg = &body[open + 1..closing(body, open).map_or(body.len(), |e| e - 1)];
            // Skip casts "(const T*)" and opening parentheses.
            let mut a = open_parens(arg);
            while let (true, Some(e)) = (a.starts_with("const "), a.find(')')) {
                a = open_parens(&a[e + 1..]);
            }
            let end = a.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(a.len());
            out.push(&a[..end]);
        }
    }
    out
}

/// The functions of `fs` whose names `body` calls (`name(` or a template's `name<`).
fn callees<'a>(body: &str, fs: &'a [Function<'a>]) -> Vec<&'a str> {
    let mut out = Vec::new();
    for f in fs {
        let called = body.match_indices(f.name).any(|(i, _)| {
            let before = body[..i].chars().next_back();
            let after = body[i + f.name.len()..].chars().next();
            !before.is_some_and(|c| c.is_alphanumeric() || c == '_') && matches!(after, Some('(' | '<'))
        });
        if called {
            out.push(f.name);
        }
    }
    out
}

/// Whether `f` waits for the kernel before it itself (`pdl_wait()` / `pdl_enter()` in its body).
fn waits(f: &Function<'_>) -> bool {
    f.body.contains("pdl_wait()") || f.body.contains("pdl_enter()")
}

/// The functions of `fs` named in `names` and every function they call, transitively.
fn with_callees<'a>(mut names: Vec<&'a str>, fs: &'a [Function<'a>]) -> Vec<&'a Function<'a>> {
    let mut i = 0;
    while i < names.len() {
        let name = names[i];
        for f in fs.iter().filter(|f| f.name == name) {
            for c in callees(f.body, fs) {
                if !names.contains(&c) {
                    names.push(c);
                }
            }
        }
        i += 1;
    }
    fs.iter().filter(|f| names.contains(&f.name)).collect()
}

/// The functions that wait and every function they call: a helper that takes an activation through a
/// `const __restrict__` parameter reads it the same way.
fn waiting_and_callees<'a>(fs: &'a [Function<'a>]) -> Vec<&'a Function<'a>> {
    with_callees(fs.iter().filter(|f| waits(f)).map(|f| f.name).collect(), fs)
}

/// Each kernel source with the prelude in front of it, as NVRTC compiles it.
fn modules() -> Vec<(&'static str, String)> {
    SOURCES.iter().map(|s| (s.module, format!("{PRELUDE}\n{}", s.src))).collect()
}

const PRELUDE: &str = include_str!("../kernels/prelude.cuh");

#[test]
fn functions_that_wait_read_earlier_kernels_outputs_coherently() {
    let mut checked = Vec::new();
    let mut bad = Vec::new();
    for (module, src) in modules() {
        let fs = functions(&src);
        for f in waiting_and_callees(&fs) {
            checked.push(f.name.to_string());
            for p in const_restrict(f.params) {
                if !READ_ONLY.contains(&p) {
                    bad.push(format!("{module}.cu: {}({p}): `const __restrict__` in a function that waits", f.name));
                }
            }
            for p in read_only_loads(f.body) {
                if !READ_ONLY.contains(&p) && !READ_ONLY_LOCALS.contains(&p) {
                    bad.push(format!(
                        "{module}.cu: {}: a read-only load through `{p}` in a function that waits",
                        f.name
                    ));
                }
            }
        }
    }
    for must in [
        "w4p_body",
        "gemv_bf16",
        "add_rms_norm_1p",
        "add_rms_norm_1p_vec",
        "gdn_decode_gated",
        "gdn_conv_gate_decode",
        "attn_decode_mma",
        "attn_decode_split",
        "attn_verify_mma",
        "qk_norm_rope",
        "w4_gemv_store",
        "gemv_fp8_tile",
        "fp8_act_quant",
    ] {
        assert!(checked.iter().any(|c| c == must), "{must} not found among the functions that wait: {checked:?}");
    }
    assert!(
        bad.is_empty(),
        "inputs written by earlier kernels of the step must not be `const __restrict__`:\n{}",
        bad.join("\n")
    );
}

/// Every kernel a launcher starts with `launch_pdl!` under a literal name (src/ops/*.rs) waits for the kernel
/// before it: a programmatic launch without `pdl_wait()` / `pdl_enter()` would read its inputs unsynchronised.
/// (Launches under a computed name: the `w4p_*`, attention decode, DeltaNet decode and RoPE kernels, listed in
/// the test above.)
#[test]
fn kernels_launched_programmatically_wait() {
    let ops = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/ops");
    let mut launched = Vec::new();
    for e in std::fs::read_dir(&ops).unwrap() {
        let text = std::fs::read_to_string(e.unwrap().path()).unwrap();
        for (i, _) in text.match_indices("launch_pdl!(k, s, \"") {
            let rest = &text[i + "launch_pdl!(k, s, \"".len()..];
            launched.push(rest[..rest.find('"').unwrap()].to_string());
        }
    }
    assert!(launched.len() >= 9, "launch_pdl! call sites with literal names: {launched:?}");
    let modules = modules();
    let parsed: Vec<Vec<Function<'_>>> = modules.iter().map(|(_, src)| functions(src)).collect();
    for name in &launched {
        let waits_somewhere = parsed.iter().any(|fs| with_callees(vec![name.as_str()], fs).iter().any(|f| waits(f)));
        assert!(waits_somewhere, "{name} is launched programmatically but does not wait for the kernel before it");
    }
}

#[test]
fn the_parser_finds_a_bad_parameter() {
    let src = "extern \"C\" __global__ void __launch_bounds__(128, 2)\nk(const float* __restrict__ x, const float* \
               __restrict__ w, float* y) {\n    pdl_enter();\n    y[0] = x[0] * w[0];\n}\n__device__ int f(int a);\n";
    let fs = functions(src);
    assert_eq!(fs.len(), 1);
    assert_eq!(fs[0].name, "k");
    assert_eq!(const_restrict(fs[0].params), ["x", "w"]);
    assert!(waits(&fs[0]));
    // A helper the waiting kernel calls is checked too (kv_write_q's kq_row took its K/V row this way).
    let src = "__device__ void h(const float* __restrict__ x, float* y) { y[0] = x[0]; }\n__device__ void u(int a)                { }\n__global__ void k(const float* x, float* y) {\n    pdl_wait();\n    h(x, y);\n}\n";
    let fs = functions(src);
    let names: Vec<&str> = waiting_and_callees(&fs).iter().map(|f| f.name).collect();
    assert_eq!(names, ["h", "k"]);
    let waits_from = |name| with_callees(vec![name], &fs).iter().any(|f| waits(f));
    assert!(waits_from("k") && !waits_from("h"));
    let body = "{ a = ld_nc(px + q); b = __ldg((const uint2*)(ps + rv)); c = ld_nc_stream(wp0 + vc); }";
    assert_eq!(read_only_loads(body), ["px", "wp0", "ps"]);
}
