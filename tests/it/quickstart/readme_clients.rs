//! The README's client snippets, run as a reader runs them: the Python, JavaScript and Go programs,
//! taken from README.md as written (the address swapped for the test proxy's, the example call replaced
//! by the test's), against the real proxy on SQLite and the stub upstream. Each sends a key and gets the
//! one execution, takes a retry's replay as the original answer, waits out a `409` and comes back with
//! the same key, and does not retry a `422`. Skipped, saying so, where `python3`, `node` or `go` is not
//! installed, and failed instead where `CI` is set (`.ci/run` installs them).

use std::process::Stdio;

use tokio::io::AsyncReadExt;
use tokio::process::Command;

use crate::support::{Backend, TestEnv, metric_reaches};

/// The README's address for the proxy, which the test replaces with its own.
const README_ADDRESS: &str = "http://localhost:8080";

/// How a snippet is run and driven: its fence, the line that starts its example call (cut off), and the
/// calls the test makes instead, which print one line per answer: `label status replayed`.
struct Snippet {
    program: &'static str,
    /// The Debian line that installs `program`, said when it is missing.
    install: &'static str,
    args: &'static [&'static str],
    /// For a compiled language: the file the program is written to (in a scratch directory) and the
    /// arguments that build it into `./snippet` there, which then runs. The build finishes before the
    /// test waits for any answer, however long a cold compiler cache makes it.
    build: Option<(&'static str, &'static [&'static str])>,
    fence: &'static str,
    example_call: &'static str,
    /// How the program names the proxy's address for the driver.
    base: &'static str,
    driver: &'static str,
}

const PYTHON: Snippet = Snippet {
    program: "python3",
    install: "apt-get install python3",
    args: &["-"],
    build: None,
    fence: "```python\n",
    example_call: "print(post_once(",
    base: "BASE = ",
    driver: r#"
import threading
def show(label, answer):
    print(label, answer[0], str(answer[2]).lower(), flush=True)
show("first", post_once(BASE + "/payments", {"amount": 100}, "demo-client", key="py-1"))
show("retry", post_once(BASE + "/payments", {"amount": 100}, "demo-client", key="py-1"))
one = threading.Thread(target=lambda: show("slow", post_once(BASE + "/slow", {"n": 1}, "demo-client", key="py-slow")))
one.start()
show("slow", post_once(BASE + "/slow", {"n": 1}, "demo-client", key="py-slow"))
one.join()
try:
    post_once(BASE + "/payments", {"amount": 999}, "demo-client", key="py-1")
    print("reused retried")
except ValueError:
    print("reused refused")
"#,
};

const JAVASCRIPT: Snippet = Snippet {
    program: "node",
    install: "apt-get install nodejs",
    args: &["--input-type=module", "-"],
    build: None,
    fence: "```js\n",
    example_call: "postOnce(\"http",
    base: "const BASE = ",
    driver: r#"
const show = (label, answer) => console.log(label, answer.status, String(answer.replayed));
show("first", await postOnce(BASE + "/payments", { amount: 100 }, "demo-client", "js-1"));
show("retry", await postOnce(BASE + "/payments", { amount: 100 }, "demo-client", "js-1"));
const slow = () => postOnce(BASE + "/slow", { n: 1 }, "demo-client", "js-slow").then((a) => show("slow", a));
await Promise.all([slow(), slow()]);
try {
  await postOnce(BASE + "/payments", { amount: 999 }, "demo-client", "js-1");
  console.log("reused retried");
} catch {
  console.log("reused refused");
}
"#,
};

const GO: Snippet = Snippet {
    program: "go",
    install: "apt-get install golang-go",
    args: &[],
    build: Some(("main.go", &["build", "-o", "snippet", "main.go"])),
    fence: "```go\n",
    example_call: "func main() {",
    base: "const BASE = ",
    driver: r#"
var _ = rand.Read // the README's main, replaced by this one, makes its key with it

func show(label string, status int, replayed bool, err error) {
	if err != nil {
		panic(err)
	}
	fmt.Println(label, status, replayed)
}

func main() {
	status, _, replayed, err := postOnce(BASE+"/payments", "demo-client", "go-1", []byte(`{"amount":100}`))
	show("first", status, replayed, err)
	status, _, replayed, err = postOnce(BASE+"/payments", "demo-client", "go-1", []byte(`{"amount":100}`))
	show("retry", status, replayed, err)
	done := make(chan bool)
	for i := 0; i < 2; i++ {
		go func() {
			status, _, replayed, err := postOnce(BASE+"/slow", "demo-client", "go-slow", []byte(`{"n":1}`))
			show("slow", status, replayed, err)
			done <- true
		}()
	}
	<-done
	<-done
	if _, _, _, err := postOnce(BASE+"/payments", "demo-client", "go-1", []byte(`{"amount":999}`)); err != nil {
		fmt.Println("reused refused")
	} else {
		fmt.Println("reused retried")
	}
}
"#,
};

/// The snippet's code in the README's "Using it from a client" section, without its example call.
fn snippet_code(snippet: &Snippet) -> String {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = &readme[readme
        .find("\n## Using it from a client\n")
        .expect("the client section")..];
    let start = section.find(snippet.fence).expect("the snippet") + snippet.fence.len();
    let code = &section[start..start + section[start..].find("```").expect("the snippet's end")];
    assert!(
        code.contains(README_ADDRESS),
        "the snippet calls {README_ADDRESS}"
    );
    let call = code
        .rfind(snippet.example_call)
        .expect("the snippet's example call");
    code[..call].to_owned()
}

/// Runs the snippet against `base` and returns the lines it printed, or `None` if its interpreter is
/// not installed (said, and a failure under CI: [`crate::support::tools::skip`]). Opens the stub's `slow` gate once the proxy has answered a duplicate `409`.
async fn run(snippet: &Snippet, env: &TestEnv, base: &str, admin: &str) -> Option<Vec<String>> {
    let version = if snippet.program == "go" {
        "version"
    } else {
        "--version"
    };
    let installed = Command::new(snippet.program).arg(version).output().await;
    if !installed.is_ok_and(|out| out.status.success()) {
        crate::support::tools::skip_missing(snippet.program, snippet.install);
        return None;
    }
    let program = format!(
        "{}\n{}\"{base}\"\n{}",
        snippet_code(snippet).replace(README_ADDRESS, base),
        snippet.base,
        snippet.driver
    );
    let scratch = tempfile::tempdir().unwrap();
    let mut command = Command::new(snippet.program);
    if let Some((file, build)) = snippet.build {
        std::fs::write(scratch.path().join(file), &program).unwrap();
        let built = Command::new(snippet.program)
            .args(build)
            .current_dir(scratch.path())
            .output()
            .await
            .unwrap();
        assert!(
            built.status.success(),
            "{} {build:?}: {}\n{program}",
            snippet.program,
            String::from_utf8_lossy(&built.stderr)
        );
        command = Command::new(scratch.path().join("snippet"));
    }
    command.args(snippet.args).current_dir(scratch.path());
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the interpreter starts");
    let mut stdin = child.stdin.take().unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stdin, program.as_bytes())
        .await
        .unwrap();
    drop(stdin);
    metric_reaches(admin, "idemproxy_requests_total", &[("outcome", "conflict")], 1.0).await;
    env.upstream.release("slow");
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .await
        .unwrap();
    let status = child.wait().await.unwrap();
    assert!(
        status.success(),
        "{} exited {status}:\n{out}\n{program}",
        snippet.program
    );
    Some(out.lines().map(str::to_owned).collect())
}

async fn the_snippet_handles_every_answer(snippet: &Snippet, key: &str) {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = env.proxy().await;
    let Some(lines) = run(snippet, &env, &proxy.url, &proxy.admin_url).await else {
        return;
    };
    let [first, retry, slow_a, slow_b, reused] = lines.as_slice() else {
        panic!("five answers expected: {lines:?}");
    };
    let status = first.split(' ').nth(1).unwrap();
    assert_eq!(first, &format!("first {status} false"), "{lines:?}");
    assert_eq!(
        retry,
        &format!("retry {status} true"),
        "the retry is a replay: {lines:?}"
    );
    let mut slow = [slow_a.as_str(), slow_b.as_str()];
    slow.sort();
    assert_eq!(
        slow,
        ["slow 201 false", "slow 201 true"],
        "the duplicate waited out its 409s and got the replay: {lines:?}"
    );
    assert_eq!(reused, "reused refused", "a 422 is not retried: {lines:?}");
    assert_eq!(env.upstream.executions_for_key(&format!("{key}-1")), 1);
    assert_eq!(env.upstream.executions_for_key(&format!("{key}-slow")), 1);
}

#[tokio::test]
async fn the_python_snippet_handles_a_replay_a_409_and_a_422() {
    the_snippet_handles_every_answer(&PYTHON, "py").await;
}

#[tokio::test]
async fn the_javascript_snippet_handles_a_replay_a_409_and_a_422() {
    the_snippet_handles_every_answer(&JAVASCRIPT, "js").await;
}

#[tokio::test]
async fn the_go_snippet_handles_a_replay_a_409_and_a_422() {
    the_snippet_handles_every_answer(&GO, "go").await;
}
