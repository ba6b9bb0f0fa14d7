// The differential suite's Go app (tests/it/attacks/differential.rs): net/http's ServeMux on 127.0.0.1:0,
// over HTTP/1.1 and, on a second listener, h2c (prior knowledge, golang.org/x/net/http2/h2c). The mux
// picks the handler by path as Go does (exact patterns, "/" for the rest); /payments and /webhooks/stripe
// run only for the method POST, as Go 1.22's "POST /payments" patterns do, and give any other method to
// the catch-all. It prints its ports as a first JSON line, then one JSON line per handler execution: the
// handler, the method and request target as Go read them, and the headers and trailers it saw, once the
// body has been read to its end (or failed).
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/h2c"
)

var out sync.Mutex

type record struct {
	Handler   string      `json:"handler"`
	Method    string      `json:"method"`
	Target    string      `json:"target"`
	Headers   [][2]string `json:"headers"`
	Trailers  [][2]string `json:"trailers"`
	BodyError *string     `json:"body_error"`
}

func pairs(h http.Header) [][2]string {
	list := [][2]string{}
	for name, values := range h {
		for _, value := range values {
			list = append(list, [2]string{strings.ToLower(name), value})
		}
	}
	sort.SliceStable(list, func(i, j int) bool { return list[i][0] < list[j][0] })
	return list
}

func executed(handler string, w http.ResponseWriter, r *http.Request) {
	_, err := io.Copy(io.Discard, r.Body)
	rec := record{Handler: handler, Method: r.Method, Target: r.RequestURI,
		Headers: pairs(r.Header), Trailers: pairs(r.Trailer)}
	if len(r.TransferEncoding) > 0 {
		rec.Headers = append(rec.Headers, [2]string{"transfer-encoding", strings.Join(r.TransferEncoding, ", ")})
	}
	if err != nil {
		text := err.Error()
		rec.BodyError = &text
	}
	line, _ := json.Marshal(rec)
	out.Lock()
	os.Stdout.Write(append(line, '\n'))
	out.Unlock()
	body := fmt.Sprintf(`{"app":"go","handler":%q}`, handler)
	w.Header().Set("content-type", "application/json")
	io.WriteString(w, body)
}

func postOnly(handler string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			executed(handler, w, r)
		} else {
			executed("other", w, r)
		}
	}
}

func listen() net.Listener {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	return l
}

func main() {
	mux := http.NewServeMux()
	mux.HandleFunc("/payments", postOnly("payments"))
	mux.HandleFunc("/webhooks/stripe", postOnly("webhook"))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { executed("other", w, r) })
	h1, h2 := listen(), listen()
	fmt.Printf(`{"listen":{"http1":%d,"h2c":%d}}`+"\n", h1.Addr().(*net.TCPAddr).Port, h2.Addr().(*net.TCPAddr).Port)
	go http.Serve(h2, h2c.NewHandler(mux, &http2.Server{}))
	panic(http.Serve(h1, mux))
}
