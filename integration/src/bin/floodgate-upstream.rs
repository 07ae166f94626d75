//! A stand-alone HTTP/1.1 upstream for the fault tests: a separate process the tests can
//! SIGKILL mid-load and start again on the same port.
//!
//! `floodgate-upstream [PORT] [DELAY_MS]` listens on `127.0.0.1:PORT` (0: ephemeral), prints
//! the address it listens on as its first line, and answers every request `200 upstream ok`
//! after `DELAY_MS` (default 0). It exits when its standard input closes, so it never outlives
//! the test that started it.

use std::convert::Infallible;
use std::io::{BufRead, Write};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

async fn answer(req: Request<Incoming>, delay: Duration) -> Result<Response<Full<Bytes>>, Infallible> {
    let _ = req.into_body().collect().await;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let mut response = Response::new(Full::new(Bytes::from_static(b"upstream ok\n")));
    response
        .headers_mut()
        .insert("content-type", hyper::header::HeaderValue::from_static("text/plain"));
    Ok(response)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let port: u16 = args.next().and_then(|a| a.parse().ok()).unwrap_or(0);
    let delay = Duration::from_millis(args.next().and_then(|a| a.parse().ok()).unwrap_or(0));
    let listener = match std::net::TcpListener::bind(("127.0.0.1", port)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("floodgate-upstream: cannot listen on 127.0.0.1:{port}: {e}");
            std::process::exit(1);
        }
    };
    listener.set_nonblocking(true).expect("nonblocking");
    let addr = listener.local_addr().expect("address");
    println!("{addr}");
    std::io::stdout().flush().expect("stdout");

    // Exit when the parent closes our stdin (or dies).
    std::thread::spawn(|| {
        let stdin = std::io::stdin();
        let mut line = String::new();
        while stdin.lock().read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
            line.clear();
        }
        std::process::exit(0);
    });

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let listener = TcpListener::from_std(listener).expect("tokio listener");
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let svc = service_fn(move |req| answer(req, delay));
                let _ = hyper::server::conn::http1::Builder::new()
                    .keep_alive(true)
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
}
