//! Writes a synthetic model-like tokenizer dir: `write_synth_tokenizer DIR [MERGEABLE]`
//! produces DIR/tokenizer.json and DIR/tokenizer_config.json (default 1024 mergeable tokens).

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().ok_or("usage: write_synth_tokenizer DIR [MERGEABLE]")?);
    let mergeable: usize = match args.next() {
        Some(n) => n.parse()?,
        None => 1024,
    };
    std::fs::create_dir_all(&dir)?;
    let json = deltaserve_text::synthetic_tokenizer_json(mergeable)?;
    std::fs::write(dir.join("tokenizer.json"), json)?;
    std::fs::write(dir.join("tokenizer_config.json"), deltaserve_text::synthetic_tokenizer_config_json_for(mergeable))?;
    println!("wrote {} (mergeable {mergeable})", dir.display());
    Ok(())
}
