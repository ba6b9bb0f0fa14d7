//! Any text as the config file: a valid configuration or one line naming a key; never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(error) = idemproxy::Config::from_toml_str(text) {
        let line = error.to_string();
        assert!(!error.key.is_empty());
        assert!(!line.contains('\n'));
    }
});
