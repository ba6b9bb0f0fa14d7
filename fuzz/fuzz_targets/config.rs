//! Any text as the config file: a valid configuration or one line per problem, each naming a key; never a
//! panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(error) = idemproxy::Config::from_toml_str(text) {
        let lines = error.to_string();
        assert_eq!(lines.lines().count(), error.problems().count());
        for (key, message) in error.problems() {
            assert!(!key.is_empty());
            assert!(!message.contains('\n'));
        }
    }
});
