//! Differential fuzzing of the checkpoint room's header validation: on any bytes, gpudirect
//! accepts exactly what the `safetensors` crate accepts (except a name given twice in one
//! header, which only gpudirect refuses), agrees on every tensor when both do, and never
//! panics.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let ours = gpudirect::safetensors::Header::from_bytes(data);
    let theirs = safetensors::SafeTensors::deserialize(data);
    match (&ours, &theirs) {
        (Ok(h), Ok(st)) => {
            assert_eq!(h.tensors.len(), st.len());
            for t in &h.tensors {
                let v = st
                    .tensor(&t.name)
                    .expect("the crate has every tensor we have");
                assert_eq!(v.dtype().to_string(), t.dtype.as_str());
                assert_eq!(v.shape(), &t.shape[..]);
                let o = t.offset as usize;
                assert_eq!(v.data(), &data[o..o + t.len as usize]);
            }
        }
        // Stricter than the crate, on purpose: a name given twice in one header, whose last
        // entry the crate keeps (as `mutations_agree_with_the_crate` allows too).
        (
            Err(gpudirect::Error::Checkpoint {
                problem: gpudirect::safetensors::Problem::DuplicateInHeader,
                ..
            }),
            Ok(_),
        ) => {}
        (Err(_), Err(_)) => {
            // Our refusal must render (names file and reason) without panicking.
            let _ = ours.map(|_| ()).unwrap_err().to_string();
        }
        _ => panic!(
            "disagreement: ours {:?}, the crate's {:?}",
            ours.map(|_| ()),
            theirs.map(|_| ())
        ),
    }
});
